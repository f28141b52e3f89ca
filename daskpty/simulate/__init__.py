"""Synthetic ptychography data sets, written straight into a sharded data-set store.

``simulate(path, preset)`` builds a structured complex object (Siemens star plus smooth blobs in
amplitude and phase), a focused-beam probe (disc aperture with a central stop and defocus, plus
optional weaker incoherent modes), a raster-with-jitter or Fermat-spiral scan with sub-pixel
positions, and then streams the patterns: one dask task per shard computes
``fftshift(model_intensities(object, probe, positions))`` for its patterns, adds Poisson noise
from a per-pattern seed, and writes the shard. Results depend only on the parameters and
``seed`` — not on the number of workers or the shard size.

Only NumPy/SciPy and the physics layer are imported at module level; dask, distributed and zarr
are imported when :func:`simulate` runs.

The package's other simulators build small data sets in memory, for tests, examples and
benchmarks: :mod:`.multislice` (thick samples: K weak-phase slices, an electron probe) and
:mod:`.variable_probe` (a probe drifting and flickering along the scan, for OPR); both are
re-exported here. :mod:`.electron` writes the ``electron`` preset: a multislice scan with its
electron geometry, optional scan errors and the ground truth, as a store.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings

import numpy as np

from ..io.scan import linear_overlap, morton_order, nearest_neighbour_steps, probe_diameter
from ..physics import model_intensities, orthogonalize_modes, split_positions
from .electron import simulate_electron
from .multislice import simulate_multislice
from .variable_probe import simulate_variable_probe

#: parameters of the named presets (any of them can be overridden)
PRESETS = {
    "small": {"grid": (24, 24), "probe_size": 64},
    "medium": {"grid": (40, 40), "probe_size": 128},
    "large": {"grid": (512, 512), "probe_size": 128},
}

#: defaults shared by all presets
DEFAULTS = {
    "scan": "raster",
    "jitter": 0.1,             # raster jitter, ± this fraction of the step (uniform)
    "overlap": 0.72,           # linear overlap used to derive the default step
    "modes": 1,
    "dose": 1e6,               # mean photons per pattern
    "wavelength_m": 1.5498e-10,  # 8 keV X-rays
    "detector_distance_m": 2.0,
    "detector_pixel_size_m": 75e-6,
}

#: aperture radius in the far field, as a fraction of the sampling frequency (cycles / pixel)
APERTURE = 0.2
#: central-stop radius as a fraction of the aperture radius
CENTRAL_STOP = 0.35
#: width (detector pixels) of the soft aperture and central-stop edges
EDGE_PX = 3.0
#: geometric diameter of the defocused beam in the probe window, as a fraction of n
DEFOCUS_DIAMETER = 0.4
#: margin (pixels) between the outermost probe windows and the object border
MARGIN = 2
#: patterns per FFT batch inside a shard task (bounds worker memory; does not change results)
BATCH = 128

_STREAM_POSITIONS, _STREAM_OBJECT, _STREAM_NOISE = 1, 2, 3

_UNSET = object()


@dataclasses.dataclass
class SimulationConfig:
    """Fully resolved parameters of one simulation (stored under the ``simulation`` attribute)."""

    preset: str
    scan: str
    n_patterns: int
    grid: tuple[int, int] | None
    step_px: float
    jitter: float
    probe_size: int
    modes: int
    mode_powers: list[float]
    dose: float | None
    dtype: str
    wavelength_m: float
    detector_distance_m: float
    detector_pixel_size_m: float
    seed: int
    probe_diameter_px: float = float("nan")
    object_shape: tuple[int, int] | None = None

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["grid"] = list(self.grid) if self.grid else None
        d["object_shape"] = list(self.object_shape) if self.object_shape else None
        return d


# --------------------------------------------------------------------------- probe

def _default_mode_powers(modes: int) -> list[float]:
    w = 0.25 ** np.arange(modes)
    return (w / w.sum()).tolist()


def _far_field_aperture(n: int, defocus_scale: float = 1.0):
    """Far-field (DC at index 0) field of the optic: soft-edged disc with central stop, defocused."""
    k = np.fft.fftfreq(n)
    ky, kx = np.meshgrid(k, k, indexing="ij")
    rho = np.hypot(ky, kx)

    def taper(distance):  # 0 → 1 over EDGE_PX detector pixels (raised cosine): tames real-space tails
        return 0.5 + 0.5 * np.sin(np.clip(distance * n / EDGE_PX, -0.5, 0.5) * np.pi)

    outer = taper(APERTURE - rho)
    inner = taper(rho - CENTRAL_STOP * APERTURE)
    c = defocus_scale * DEFOCUS_DIAMETER * n / (2 * APERTURE)  # beam diameter = 2 c APERTURE
    return outer * inner * np.exp(1j * np.pi * c * rho**2), ky / APERTURE, kx / APERTURE


def make_probe(n: int, modes: int = 1, mode_powers=None, defocus_scale: float = 1.0):
    """Focused-beam probe modes (M, n, n) complex64, centred in the window, total power 1.

    Mode 0 is the defocused image of a disc aperture with a central stop (Fresnel-zone-plate-like
    focus). Further modes are the same optic modulated by low-order polynomials of the aperture
    coordinates; all modes are orthogonalised (SVD) and scaled to the power fractions
    ``mode_powers`` (default ∝ 1, 1/4, 1/16, ...).
    """
    if modes < 1:
        raise ValueError(f"modes must be >= 1, got {modes}")
    powers = _default_mode_powers(modes) if mode_powers is None else list(map(float, mode_powers))
    if len(powers) != modes or min(powers) <= 0:
        raise ValueError(f"mode_powers must be {modes} positive numbers, got {mode_powers}")
    powers = np.asarray(powers) / np.sum(powers)
    field, v, u = _far_field_aperture(n, defocus_scale)
    variations = [np.ones_like(u), u, v, u * u - v * v, 2 * u * v, u * u + v * v - 0.5,
                  u * (u * u + v * v), v * (u * u + v * v)]
    if modes > len(variations):
        raise ValueError(f"at most {len(variations)} probe modes are supported, got {modes}")
    far = np.stack([field * variations[k] for k in range(modes)])
    probe = np.fft.fftshift(np.fft.ifft2(far, norm="ortho"), axes=(-2, -1)).astype(np.complex64)
    probe = orthogonalize_modes(probe)
    power = (np.abs(probe.astype(np.complex128)) ** 2).sum(axis=(-2, -1))
    probe = probe * np.sqrt(powers / power)[:, None, None]
    return probe.astype(np.complex64)


# --------------------------------------------------------------------------- scan

def make_positions(scan: str, n_patterns: int, grid, step: float, jitter: float, n: int, rng,
                   acquisition_order: bool = False):
    """Scan positions (N, 2) float64 in object pixels, in a spatially compact (Morton) order
    (``acquisition_order``: as an instrument visits them, row by row or along the spiral),
    shifted so every probe window starts at least MARGIN pixels inside the object."""
    if scan == "raster":
        rows, cols = grid
        iy, ix = np.divmod(np.arange(rows * cols)[:n_patterns], cols)
        pos = np.stack([iy, ix], axis=1).astype(np.float64) * step
    elif scan == "fermat":
        k = np.arange(n_patterns, dtype=np.float64)
        r = step / math.sqrt(math.pi) * np.sqrt(k + 0.5)
        theta = k * math.pi * (3.0 - math.sqrt(5.0))  # golden angle
        pos = np.stack([r * np.sin(theta), r * np.cos(theta)], axis=1)
    else:
        raise ValueError(f"unknown scan {scan!r}; use 'raster' or 'fermat'")
    if jitter:
        pos = pos + rng.uniform(-jitter * step, jitter * step, size=pos.shape)
    pos += (n / 2.0 + MARGIN) - pos.min(axis=0)
    return pos if acquisition_order else pos[morton_order(pos, step)]


def object_shape_for(positions, n: int) -> tuple[int, int]:
    corners, _ = split_positions(positions, n)
    hi = corners.max(axis=0) + n + MARGIN
    return int(hi[0]), int(hi[1])


# --------------------------------------------------------------------------- object

def _smooth_field(shape, factor: int, rng) -> np.ndarray:
    """Smooth random field in [0, 1] with correlation length ~``factor`` pixels (float32)."""
    from scipy import ndimage

    h, w = shape
    coarse = rng.standard_normal((math.ceil(h / factor) + 4, math.ceil(w / factor) + 4))
    fine = ndimage.zoom(coarse.astype(np.float32), factor, order=3, output=np.float32,
                        grid_mode=False)
    fine = fine[factor:factor + h, factor:factor + w]
    lo, hi = float(fine.min()), float(fine.max())
    return (fine - lo) / max(hi - lo, 1e-12)


def make_object(shape, rng, rows_per_block: int = 1024) -> np.ndarray:
    """Structured complex object (H, W) complex64: a Siemens star plus smooth blobs.

    Amplitude in [0.5, 1], phase in [-1, 1] rad. Built in row blocks to bound memory.
    """
    h, w = shape
    blob_a = 0.6 * _smooth_field(shape, 48, rng) + 0.4 * _smooth_field(shape, 12, rng)
    blob_p = 0.6 * _smooth_field(shape, 64, rng) + 0.4 * _smooth_field(shape, 16, rng)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    radius = 0.45 * min(h, w)
    spokes = max(8, 2 * round(math.pi * radius / 32.0))  # ~32 px period at the rim
    obj = np.empty((h, w), dtype=np.complex64)
    x = np.arange(w, dtype=np.float32) - np.float32(cx)
    for r0 in range(0, h, rows_per_block):
        r1 = min(h, r0 + rows_per_block)
        y = (np.arange(r0, r1, dtype=np.float32) - np.float32(cy))[:, None]
        r = np.hypot(y, x[None, :])
        theta = np.arctan2(y, x[None, :])
        # signed distance (pixels) to the nearest spoke edge: anti-aliased over ~1 px
        star = np.clip(0.5 + np.sin(spokes * theta) * r / spokes, 0.0, 1.0)
        disc = np.clip(radius - r + 0.5, 0.0, 1.0)
        star_d = star * disc
        amp = 1.0 - 0.3 * star_d - 0.2 * blob_a[r0:r1]
        phase = 0.5 * (2.0 * star - 1.0) * disc + 0.5 * (2.0 * blob_p[r0:r1] - 1.0)
        obj[r0:r1] = amp * np.exp(1j * phase)
    return obj


# --------------------------------------------------------------------------- per-shard task

def _noise_rng(seed: int, index: int):
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _STREAM_NOISE, index])))


def simulate_patterns(obj, probe, positions, start: int, seed: int, dose, dtype) -> tuple:
    """Patterns for ``positions`` (the data set's patterns start, start+1, ...), DC-centred.

    Returns ``(patterns, stats)``; noise uses one generator per pattern index, so the values do
    not depend on how patterns are grouped into shards, batches or workers.
    """
    dtype = np.dtype(dtype)
    n = probe.shape[-1]
    out = np.empty((len(positions), n, n), dtype=dtype)
    limit = np.iinfo(dtype).max if dtype.kind in "iu" else None
    saturated = 0
    for b0 in range(0, len(positions), BATCH):
        b1 = min(len(positions), b0 + BATCH)
        lam = np.fft.fftshift(model_intensities(obj, probe, positions[b0:b1]), axes=(-2, -1))
        if dose is None:
            out[b0:b1] = lam
            continue
        for j in range(b1 - b0):
            counts = _noise_rng(seed, start + b0 + j).poisson(lam[j])
            if limit is not None:
                over = counts > limit
                if over.any():
                    saturated += int(over.sum())
                    counts = np.minimum(counts, limit)
            out[b0 + j] = counts
    stats = {"patterns": len(positions), "saturated": saturated,
             "total": float(out.sum(dtype=np.float64)), "max": float(out.max()) if out.size else 0.0}
    return out, stats


def _simulate_shard(arr, root, obj, probe, positions, start, seed, dose, dtype):
    from ..io.writing import guarded_write

    t0 = time.perf_counter()
    patterns, stats = simulate_patterns(obj, probe, positions, start, seed, dose, dtype)
    t1 = time.perf_counter()
    guarded_write(arr, root, start, patterns)
    stats["compute_s"], stats["write_s"] = t1 - t0, time.perf_counter() - t1
    return stats


# --------------------------------------------------------------------------- driver

def _resolve(preset, scan, grid, n_patterns, step, jitter, overlap, probe_size, modes, mode_powers,
             dose, dtype, wavelength_m, detector_distance_m, detector_pixel_size_m, seed):
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = {**DEFAULTS, **PRESETS[preset]}
    scan = p["scan"] if scan is None else scan
    if scan not in ("raster", "fermat"):
        raise ValueError(f"unknown scan {scan!r}; use 'raster' or 'fermat'")
    if grid is not None and n_patterns is not None:
        raise ValueError("give either grid or n_patterns, not both")
    if n_patterns is not None:
        n_patterns = int(n_patterns)
        if n_patterns < 1:
            raise ValueError(f"n_patterns must be >= 1, got {n_patterns}")
        rows = math.ceil(math.sqrt(n_patterns))
        grid = (rows, math.ceil(n_patterns / rows))
    else:
        grid = tuple(int(g) for g in (p["grid"] if grid is None else grid))
        if len(grid) != 2 or min(grid) < 1:
            raise ValueError(f"grid must be two positive integers (rows, columns), got {grid}")
        n_patterns = grid[0] * grid[1]
    n = int(p["probe_size"] if probe_size is None else probe_size)
    if n < 8 or n % 2:
        raise ValueError(f"probe size must be an even number >= 8, got {n}")
    modes = int(p["modes"] if modes is None else modes)
    powers = _default_mode_powers(modes) if mode_powers is None else [float(v) for v in mode_powers]
    if len(powers) != modes or min(powers) <= 0:
        raise ValueError(f"mode_powers must be {modes} positive numbers, got {mode_powers}")
    powers = (np.asarray(powers) / sum(powers)).tolist()
    dose = p["dose"] if dose is _UNSET else dose
    if dose is not None:
        dose = float(dose)
        if not math.isfinite(dose) or dose <= 0:
            raise ValueError(f"dose must be a positive number of photons per pattern, got {dose}")
    if dtype is None:
        dtype = "uint16" if dose is not None else "float32"
    dtype = str(np.dtype(dtype))
    if dtype not in ("uint16", "uint32", "float32"):
        raise ValueError(f"dtype must be uint16, uint32 or float32, got {dtype}")
    if dose is None and dtype != "float32":
        raise ValueError("noise-free data (dose=None) are stored as float32; drop the integer dtype")
    jitter = float(p["jitter"] if jitter is None else jitter)
    if not 0 <= jitter < 0.5:
        raise ValueError(f"jitter must be in [0, 0.5) (fraction of the step), got {jitter}")
    overlap = float(p["overlap"] if overlap is None else overlap)
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    if step is not None:
        step = float(step)
        if not math.isfinite(step) or step <= 0:
            raise ValueError(f"step must be a positive number of pixels, got {step}")
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    geometry = {}
    for key, value in (("wavelength_m", wavelength_m), ("detector_distance_m", detector_distance_m),
                       ("detector_pixel_size_m", detector_pixel_size_m)):
        value = float(p[key] if value is None else value)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{key} must be a positive number, got {value}")
        geometry[key] = value
    cfg = SimulationConfig(preset=preset, scan=scan, n_patterns=n_patterns,
                           grid=grid if scan == "raster" else None, step_px=step or 0.0,
                           jitter=jitter, probe_size=n, modes=modes, mode_powers=powers, dose=dose,
                           dtype=dtype, seed=seed, **geometry)
    return cfg, overlap, step is None


def _probe_scale(obj, probe, positions, target: float, sample: int = 1024) -> float:
    """Factor for the probe *power* so the mean pattern sum over (a sample of) the scan = target."""
    idx = np.unique(np.linspace(0, len(positions) - 1, min(sample, len(positions))).astype(int))
    sums = []
    for b0 in range(0, len(idx), BATCH):
        sums.append(model_intensities(obj, probe, positions[idx[b0:b0 + BATCH]])
                    .sum(axis=(-2, -1), dtype=np.float64))
    mean = float(np.concatenate(sums).mean())
    if not mean > 0:
        raise ValueError("the object is zero under every probe window; nothing to simulate")
    return target / mean


def simulate(path, preset: str = "small", *, scan: str | None = None, grid=None,
             n_patterns: int | None = None, step: float | None = None, jitter: float | None = None,
             overlap: float | None = None, probe_size: int | None = None, modes: int | None = None,
             mode_powers=None, dose=_UNSET, dtype=None, wavelength_m: float | None = None,
             detector_distance_m: float | None = None, detector_pixel_size_m: float | None = None,
             object="star", initial_probe: bool = True, shard_bytes: int | None = None,
             seed: int = 0, client=None, n_workers: int | None = None, progress: bool = False,
             overwrite: bool = False, rate: float | None = None, **electron):
    """Simulate a ptychography data set into a new store at ``path``; return it (``PtychoData``).

    Presets: ``small`` (24×24 raster, 64² patterns), ``medium`` (40×40, 128²), ``large``
    (512×512, 128², 8 GiB as uint16), ``electron`` (a 3-slice 4D-STEM scan, 12×12 × 64²:
    :mod:`.electron`; it takes ``grid``, ``step``, ``probe_size``, ``dose``, ``seed`` and, as
    further keywords, ``slices``, ``slice_spacing_m``, ``energy_ev``,
    ``convergence_semiangle_mrad``, ``defocus_m``, ``position_errors``). Overrides: ``scan`` ("raster" with jitter, or "fermat"
    spiral), ``grid`` (rows, cols) or ``n_patterns``, ``step`` in pixels (default: from the
    probe diameter for a linear ``overlap`` of 0.72), ``jitter`` (fraction of the step),
    ``probe_size`` n, ``modes`` and ``mode_powers``, ``dose`` (mean photons per pattern, Poisson
    noise; ``None`` = noise-free float32 normalised to a mean of one count per pixel), ``dtype``,
    detector geometry, ``object`` ("star", "flat" or a complex 2-D array covering the scan),
    ``initial_probe`` (also write a slightly wrong single-mode ``probe`` guess), ``shard_bytes``,
    ``seed``. Runs on ``client``, the current client, or an embedded LocalCluster
    (``n_workers``); the ground truth goes into ``truth/``.

    ``rate`` (frames per second): an acquisition stand-in instead. The frames are computed in
    this process in the order the scan visits them and written at that rate, a quarter of a
    second per block, through :class:`daskpty.ScanWriter` into a live store that other
    processes can read while it grows (:mod:`.acquire`).
    """
    if preset == "electron":
        given = {k: v for k, v in dict(scan=scan, n_patterns=n_patterns, jitter=jitter, overlap=overlap,
                                       modes=modes, mode_powers=mode_powers, dtype=dtype,
                                       wavelength_m=wavelength_m, detector_distance_m=detector_distance_m,
                                       detector_pixel_size_m=detector_pixel_size_m).items() if v is not None}
        if given or not isinstance(object, str) or object != "star":
            raise ValueError(f"the electron preset does not take {', '.join(given) or 'object'}; it "
                             "takes grid, step, probe_size, dose, seed and the electron settings")
        return simulate_electron(path, grid=grid, step=step, probe_size=probe_size,
                                 dose=None if dose is _UNSET else dose, noise_free=dose is None,
                                 seed=seed, shard_bytes=shard_bytes, overwrite=overwrite, client=client,
                                 **electron)
    if electron:
        raise ValueError(f"{', '.join(sorted(electron))} apply to the electron preset only")
    if rate is not None and not (math.isfinite(float(rate)) and float(rate) > 0):
        raise ValueError(f"rate must be a positive number of frames per second, got {rate}")
    if rate is not None and (client is not None or n_workers is not None):
        raise ValueError("a simulation at a frame rate computes in its own process; drop the "
                         "client / workers")
    from ..execution.cluster import client_context
    from ..io.progress import TextProgress
    from ..io.metadata import Truth, make_metadata
    from ..io.store import open_data
    from ..io.writing import DEFAULT_SHARD_BYTES, atomic_store, check_target, create_store, shard_layout

    cfg, overlap, derive_step = _resolve(
        preset, scan, grid, n_patterns, step, jitter, overlap, probe_size, modes, mode_powers,
        dose, dtype, wavelength_m, detector_distance_m, detector_pixel_size_m, seed)
    check_target(os.path.abspath(os.fspath(path)), overwrite)
    n = cfg.probe_size

    probe = make_probe(n, cfg.modes, cfg.mode_powers)
    cfg.probe_diameter_px = probe_diameter(probe)
    if derive_step:
        cfg.step_px = round((1.0 - overlap) * cfg.probe_diameter_px, 3)
    rng_pos = np.random.default_rng(np.random.SeedSequence([cfg.seed, _STREAM_POSITIONS]))
    positions = make_positions(cfg.scan, cfg.n_patterns, cfg.grid, cfg.step_px, cfg.jitter, n,
                               rng_pos, acquisition_order=rate is not None)

    shape = object_shape_for(positions, n)
    if isinstance(object, str):
        if object == "star":
            rng_obj = np.random.default_rng(np.random.SeedSequence([cfg.seed, _STREAM_OBJECT]))
            obj = make_object(shape, rng_obj)
        elif object == "flat":
            obj = np.ones(shape, dtype=np.complex64)
        else:
            raise ValueError(f"object must be 'star', 'flat' or a complex 2-D array, got {object!r}")
    else:
        obj = np.asarray(object)
        if obj.ndim != 2:
            raise ValueError(f"object must be a 2-D array, got shape {obj.shape}")
        if obj.shape[0] < shape[0] or obj.shape[1] < shape[1]:
            raise ValueError(f"object of shape {obj.shape} does not cover the scan; it needs at "
                             f"least {shape}")
        obj = obj.astype(np.complex64)
    cfg.object_shape = tuple(int(s) for s in obj.shape)

    target = cfg.dose if cfg.dose is not None else float(n * n)
    probe = (probe * np.sqrt(_probe_scale(obj, probe, positions, target))).astype(np.complex64)
    guess = None
    if initial_probe:
        guess = make_probe(n, 1, None, defocus_scale=1.1)
        guess = (guess * np.sqrt(np.sum(np.abs(probe) ** 2) / np.sum(np.abs(guess) ** 2))
                 ).astype(np.complex64)

    steps = nearest_neighbour_steps(positions)
    provenance = (f"simulated by daskpty simulate: preset={cfg.preset} scan={cfg.scan} "
                  f"patterns={cfg.n_patterns} n={n} modes={cfg.modes} dose={cfg.dose} "
                  f"seed={cfg.seed}")
    sim_meta = cfg.as_dict()
    sim_meta["median_step_px"] = float(np.median(steps)) if len(steps) else None
    sim_meta["linear_overlap"] = linear_overlap(sim_meta["median_step_px"] or float("nan"),
                                                cfg.probe_diameter_px)
    meta = make_metadata(pattern_size=n, wavelength_m=cfg.wavelength_m,
                         detector_distance_m=cfg.detector_distance_m,
                         detector_pixel_size_m=cfg.detector_pixel_size_m, provenance=provenance,
                         extra={"simulation": sim_meta})
    data_shape = (cfg.n_patterns, n, n)
    shard, inner = shard_layout(data_shape, cfg.dtype, shard_bytes or DEFAULT_SHARD_BYTES)
    truth = Truth(object=obj, probe=probe, positions=positions)
    if rate is not None:
        from .acquire import acquire

        meta["simulation"]["rate_hz"] = float(rate)
        acquire(path, cfg, meta, obj, probe, guess, positions, truth, float(rate), simulate_patterns,
                overwrite=overwrite, progress=progress)
        return open_data(path)

    with atomic_store(path, overwrite=overwrite) as tmp:
        arr = create_store(tmp, shape=data_shape, dtype=cfg.dtype, shard_len=shard,
                           inner_len=inner, positions=positions, probe=guess, metadata=meta,
                           truth=truth)
        starts = list(range(0, cfg.n_patterns, shard))
        totals = {"saturated": 0, "total": 0.0, "max": 0.0}
        with client_context(client, n_workers=n_workers) as c:
            from distributed import as_completed

            obj_f = c.scatter(obj, broadcast=True, hash=False)
            futures = [c.submit(_simulate_shard, arr, tmp, obj_f, probe,
                                positions[s:s + shard], s, cfg.seed, cfg.dose, cfg.dtype,
                                pure=False)
                       for s in starts]
            bar = TextProgress(len(starts), "simulate", item="patterns", enabled=progress)
            try:
                for fut in as_completed(futures, loop=c.loop):
                    st = fut.result()
                    totals["saturated"] += st["saturated"]
                    totals["total"] += st["total"]
                    totals["max"] = max(totals["max"], st["max"])
                    totals["compute_s"] = totals.get("compute_s", 0.0) + st["compute_s"]
                    totals["write_s"] = totals.get("write_s", 0.0) + st["write_s"]
                    bar.update(1, st["patterns"])
            except BaseException:
                c.cancel(futures)
                raise
            finally:
                bar.close()
                c.cancel([obj_f])
        import zarr

        group = zarr.open_group(tmp, mode="r+")
        sim = dict(group.attrs["simulation"])
        sim["saturated_values"] = totals["saturated"]
        sim["mean_counts_per_pattern"] = totals["total"] / cfg.n_patterns
        sim["max_count"] = totals["max"]
        sim["worker_seconds"] = {"compute": round(totals.get("compute_s", 0.0), 3),
                                 "write": round(totals.get("write_s", 0.0), 3)}
        group.attrs["simulation"] = sim
    if totals["saturated"]:
        warnings.warn(f"{totals['saturated']} pixel values exceeded the {cfg.dtype} range and were "
                      f"clipped (detector saturation); use dtype='uint32' or a lower dose",
                      stacklevel=2)
    return open_data(path)


__all__ = ["DEFAULTS", "PRESETS", "SimulationConfig", "make_object", "make_positions",
           "make_probe", "simulate", "simulate_electron", "simulate_multislice", "simulate_patterns", "simulate_variable_probe"]
