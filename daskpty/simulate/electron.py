"""The ``electron`` preset: a small multislice 4D-STEM scan with ground truth, written to a store.

:func:`.multislice.simulate_multislice` makes K weak-phase slices, a probe focused through a
condenser aperture with defocus, a raster scan with jitter and (with a dose) Poisson noise; the
store then holds what a measured electron scan would: the patterns, the scan positions, the
geometry (``electron_voltage_v``, ``convergence_semiangle_rad``, the object pixel size, the
nominal ``defocus_m``, 10 % off the true one; the slice spacing and the true values under
``simulation``) and a start probe from those nominal optics. ``truth/`` holds the K slices, the
probe and the true positions. Defoci are measured at the sample's entrance surface; both probes
live at the first slice, half a slice spacing in (:func:`.multislice.simulate_multislice`).

Scan errors (``position_errors``): the stored positions are the true ones turned by ``rotation``
degrees and stretched by ``1 + scale`` about the scan's centre, plus Gaussian noise of ``rms`` px
per axis — what a reconstruction starts from, while ``truth/positions`` keeps where the beam was.

Small on purpose: the default (144 patterns of 64², 3 slices) reconstructs in seconds on a laptop.
Everything is computed in this process (NumPy); only writing the store uses dask.
"""
from __future__ import annotations

import math

import numpy as np

from ..physics.geometry import electron_wavelength_m
from ..physics.probes import electron_probe
from .multislice import simulate_multislice

#: the preset's parameters (each can be overridden)
ELECTRON = {
    "probe_size": 64,
    "grid": (12, 12),
    "step": 3.0,                      # object pixels
    "slices": 3,
    "slice_spacing_m": 2e-9,
    "energy_ev": 300e3,
    "object_pixel_size_m": 0.25e-10,
    "convergence_semiangle_mrad": 25.0,
    "defocus_m": 6e-9,
    "dose": 1e6,                      # electrons per pattern
    "jitter": 0.5,                    # ± px, uniform
}
#: scan errors of ``position_errors=True`` (``--position-errors`` without values)
POSITION_ERRORS = {"rms": 0.5, "scale": 0.01, "rotation": 1.0}
#: the start probe's defocus, relative to the true one
GUESS_DEFOCUS = 1.1


def resolve_position_errors(value) -> dict | None:
    """``position_errors`` as ``{"rms": px, "scale": fraction, "rotation": degrees}`` or None."""
    if value is None or value is False:
        return None
    if value is True:
        return dict(POSITION_ERRORS)
    if not isinstance(value, dict):
        raise ValueError(f"position_errors must be True or a dict of rms, scale, rotation; got {value!r}")
    unknown = sorted(set(value) - set(POSITION_ERRORS))
    if unknown:
        raise ValueError(f"unknown position error {unknown[0]!r}; use rms (px), scale (fraction) and "
                         "rotation (degrees), e.g. rms=0.5,scale=0.01,rotation=1")
    out = {k: 0.0 for k in POSITION_ERRORS}
    for key, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"position error {key} must be a number, got {v!r}")
        out[key] = float(v)
    if out["rms"] < 0 or abs(out["scale"]) >= 0.5:
        raise ValueError(f"position errors need rms >= 0 px and |scale| < 0.5, got {out}")
    return out


def perturb(positions, rms: float, scale: float, rotation: float, rng) -> np.ndarray:
    """Nominal positions: ``positions`` turned by ``rotation`` degrees and stretched by ``1 + scale``
    about their centre, plus Gaussian noise of ``rms`` px per axis."""
    centre = positions.mean(axis=0)
    t = math.radians(rotation)
    m = (1.0 + scale) * np.array([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]])
    return (positions - centre) @ m.T + centre + rng.normal(0.0, rms, positions.shape)


def _resolve(overrides: dict) -> dict:
    p = {**ELECTRON, **{k: v for k, v in overrides.items() if v is not None}}
    rows, cols = (int(g) for g in p["grid"])
    if rows < 2 or cols < 2:
        raise ValueError(f"the electron preset needs a grid of at least 2x2, got {rows}x{cols}")
    p["grid"] = (rows, cols)
    n = int(p["probe_size"])
    if n < 16 or n % 2:
        raise ValueError(f"probe size must be an even number >= 16, got {n}")
    p["probe_size"] = n
    k = p["slices"]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"slices must be an integer >= 1, got {k!r}")
    for key in ("step", "slice_spacing_m", "energy_ev", "object_pixel_size_m",
                "convergence_semiangle_mrad"):
        v = float(p[key])
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{key} must be a positive number, got {p[key]!r}")
        p[key] = v
    if not math.isfinite(float(p["defocus_m"])):
        raise ValueError(f"defocus_m must be a finite number of metres, got {p['defocus_m']!r}")
    if p["dose"] is not None and not (math.isfinite(float(p["dose"])) and float(p["dose"]) > 0):
        raise ValueError(f"dose must be a positive number of electrons per pattern, got {p['dose']!r}")
    return p


def simulate_electron(path, *, grid=None, step=None, probe_size=None, slices=None,
                      slice_spacing_m=None, energy_ev=None, convergence_semiangle_mrad=None,
                      defocus_m=None, dose=None, noise_free: bool = False, position_errors=None,
                      seed: int = 0, shard_bytes: int | None = None, overwrite: bool = False,
                      client=None):
    """Write the ``electron`` preset (overrides as keywords; None: the preset's value) to ``path``.

    ``noise_free=True`` stores the expected counts as float32 instead of Poisson counts;
    ``position_errors``: True (:data:`POSITION_ERRORS`) or a dict of ``rms``, ``scale``,
    ``rotation``. Returns the store opened (``PtychoData``).
    """
    from ..io.store import from_arrays  # lazy: dask and zarr only when a store is written

    p = _resolve(dict(grid=grid, step=step, probe_size=probe_size, slices=slices,
                      slice_spacing_m=slice_spacing_m, energy_ev=energy_ev,
                      convergence_semiangle_mrad=convergence_semiangle_mrad, defocus_m=defocus_m,
                      dose=dose))
    errors = resolve_position_errors(position_errors)
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    n, alpha = p["probe_size"], p["convergence_semiangle_mrad"] * 1e-3
    sim = simulate_multislice(n=n, n_slices=p["slices"], grid=p["grid"], step=p["step"],
                              voltage_v=p["energy_ev"], pixel_size_m=p["object_pixel_size_m"],
                              spacing_m=p["slice_spacing_m"], convergence_semiangle_rad=alpha,
                              defocus_m=p["defocus_m"], photons=float(p["dose"]),
                              noise=not noise_free, jitter=p["jitter"], seed=seed)
    true = sim.positions
    nominal = true
    if errors is not None:
        rng = np.random.default_rng(np.random.SeedSequence([seed, 7]))
        nominal = perturb(true, rng=rng, **errors)
    lam = electron_wavelength_m(p["energy_ev"])
    # the nominal defocus is at the entrance surface; the start probe at the first slice (as
    # probe="aperture" builds it)
    first_screen = 0.5 * p["slice_spacing_m"] if p["slices"] > 1 else 0.0
    guess = electron_probe(n, p["object_pixel_size_m"], lam, alpha,
                           defocus_m=GUESS_DEFOCUS * p["defocus_m"] + first_screen, power=float(p["dose"]))
    intensities = sim.intensities.astype(np.float32)
    if not noise_free:
        intensities = intensities.astype(np.uint32 if intensities.max() > 65535 else np.uint16)
    offset = nominal - true
    offset = offset - offset.mean(axis=0)  # a common shift is only the object frame's origin
    record = {"preset": "electron", **p, "grid": list(p["grid"]), "dose": None if noise_free else p["dose"],
              "wavelength_m": lam, "n_patterns": len(true), "seed": seed,
              "position_errors": errors,
              "position_error_rms_px": float(np.sqrt((offset ** 2).sum(axis=1).mean())),
              "object_shape": list(sim.truth.slices.shape)}
    provenance = (f"simulated by daskpty simulate: preset=electron patterns={len(true)} n={n} "
                  f"slices={p['slices']} dose={record['dose']} seed={seed}")
    data = from_arrays(intensities, nominal, probe=guess, object_pixel_size_m=p["object_pixel_size_m"],
                       electron_voltage_v=p["energy_ev"], convergence_semiangle_rad=alpha,
                       provenance=provenance,
                       metadata={"simulation": record, "defocus_m": GUESS_DEFOCUS * p["defocus_m"]},
                       truth={"object": sim.truth.slices, "probe": sim.truth.probe, "positions": true})
    kw = {} if shard_bytes is None else {"shard_bytes": int(shard_bytes)}
    return data.to_zarr(path, overwrite=overwrite, client=client, **kw)
