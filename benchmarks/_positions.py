"""The position-error case shared by bench_positions.py and bench_vs_ptychi.py --position-errors.

A simulated scan (``daskpty.simulate`` preset) keeps its true positions for evaluation; both
codes get the same *nominal* positions: the true ones scaled by ``1 + scale`` and rotated by
``rot_deg`` about the scan centre, plus Gaussian noise of ``rms`` px **per axis** (as
tests/test_positions.py ``perturb``; the rms distance of the random part is then ``rms·√2``).

Evaluation (both codes, every run):

* position error = rms distance between refined and true positions after removing the global
  offset (mean difference: the object frame's shift is arbitrary); as extra information also
  after removing a global affine map (least squares, refined ≈ A·[true, 1]).
* object NRMSE (primary) = ``daskpty.metrics.nrmse`` of the reconstruction placed in the truth's
  frame by the integer offset round(median(refined − true)) (``metrics.truth_frame``, as the
  existing helper ``common.object_nrmse_in_truth_frame``), then aligned by nrmse itself (complex
  scale, sub-pixel shift, phase ramp). So a global *translation* of the refined scan is not an
  error, but a residual global scale or rotation of the positions (which stretches or turns the
  object) is. Region: where the TRUE probe at the TRUE positions gives > 30 % of the maximum
  illumination (the same mask for every run and both codes).
* object NRMSE after affine registration (extra): the reconstruction resampled (cubic) onto the
  truth's pixel grid through the affine map fitted from true to refined positions; this forgives
  a residual global scale/rotation/shear and shows how much of the error is that global part.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import simulated  # noqa: E402


def perturb(positions, rms=1.0, scale=0.015, rot_deg=0.5, seed=1):
    """Nominal positions: true ones scaled and rotated about the scan centre, plus noise."""
    rng = np.random.default_rng(seed)
    positions = np.asarray(positions, dtype=np.float64)
    centre = positions.mean(axis=0)
    t = np.radians(rot_deg)
    m = (1 + scale) * np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
    return (positions - centre) @ m.T + centre + rng.normal(0, rms, positions.shape)


def parse_errors(text):
    rms, scale, rot = (float(v) for v in text.split(","))
    return rms, scale, rot


def affine_fit(src, dst):
    """A (3, 2) with dst ≈ [src, 1] · A (least squares)."""
    x = np.c_[np.asarray(src, dtype=np.float64), np.ones(len(src))]
    return np.linalg.lstsq(x, np.asarray(dst, dtype=np.float64), rcond=None)[0]


def position_error(p, truth) -> float:
    d = np.asarray(p) - truth
    d = d - d.mean(axis=0)
    return float(np.sqrt((d ** 2).sum(axis=1).mean()))


def position_error_affine(p, truth) -> float:
    a = affine_fit(truth, p)
    d = np.asarray(p) - np.c_[truth, np.ones(len(truth))] @ a
    return float(np.sqrt((d ** 2).sum(axis=1).mean()))


def affine_vs_truth(p, truth) -> dict:
    """Scale / rotation / shear of the map true → refined (daskpty's affine_parameters)."""
    from daskpty.engines.positions import affine_parameters

    return affine_parameters(affine_fit(truth, p))


#: The calibration scan of ``start_probe="reference"``: the same optics and preset, another
#: object and noise (simulator seed), reconstructed at its own true positions.
REFERENCE_SEED, REFERENCE_EPOCHS = 7, 100


def reference_probe(path, preset="small") -> np.ndarray:
    """The probe a beamline would start from: reconstructed (LSQML, ``REFERENCE_EPOCHS``, from
    the store's guess) from a calibration scan with known positions — the simulator's preset
    with seed ``REFERENCE_SEED`` (the same optics; a new object, jitter and noise). Kept next to
    ``path`` (``<path>.reference.npy``) for later runs."""
    import daskpty

    cached = f"{path}.reference.npy"
    if os.path.exists(cached):
        return np.load(cached)
    ref = simulated(f"{path}.reference.zarr", preset=preset, seed=REFERENCE_SEED)
    rec = daskpty.reconstruct(ref, epochs=REFERENCE_EPOCHS, n_workers=2)
    probe = np.asarray(rec.probe, dtype=np.complex64)
    np.save(cached, probe)
    return probe


class Case:
    """Simulated data, truth, nominal positions and the common reconstruction frame."""

    def __init__(self, path, preset="small", errors=(1.0, 0.015, 0.5), seed=1, start_probe="data"):
        """``start_probe``: the probe every run starts from — ``"data"``, the store's own guess
        (the simulator's: nominal optics with a 10 % defocus error), ``"reference"``, the probe
        of a calibration scan (:func:`reference_probe`), or ``"mean-pattern"``, an
        aperture guessed from the mean pattern and the nominal scan's step. The second is far
        worse for refinement: the scan contracts by ~0.7 % to fit the wrong probe size (1 px
        random errors, 50 epochs: 1.21 px left vs 0.61 px from the store's guess)."""
        from daskpty.engines.initial import object_frame, probe_diameter_from_scan, probe_from_mean_pattern
        from daskpty.metrics import illumination_map

        data = simulated(path, preset=preset)
        self.data = data
        self.intensities = np.asarray(data.intensities.compute(), dtype=np.float32)
        self.n = n = self.intensities.shape[-1]
        self.truth = data.truth
        self.true_data = np.asarray(data.positions, dtype=np.float64)  # data frame (= truth frame here)
        self.nominal_data = perturb(self.true_data, *errors, seed=seed)
        self.errors = errors
        # one frame for every run: it covers the true and the nominal scan
        self.shape, origin = object_frame(np.vstack([self.true_data, self.nominal_data]), n)
        self.true = self.true_data + origin
        self.nominal = self.nominal_data + origin
        if start_probe == "reference":
            self.probe = reference_probe(path, preset)
        elif start_probe == "data" and getattr(data, "probe", None) is not None:
            self.probe = np.asarray(data.probe, dtype=np.complex64)
        elif start_probe in ("data", "mean-pattern"):
            self.probe = probe_from_mean_pattern(self.intensities.mean(axis=0),
                                                 diameter=probe_diameter_from_scan(self.nominal_data, n))
        else:
            raise ValueError(f"start_probe must be 'data', 'mean-pattern' or 'reference', got {start_probe!r}")
        self.start_probe = start_probe
        self.object = np.ones(self.shape, np.complex64)
        illum = illumination_map(self.truth.probe, self.truth.positions, self.truth.object.shape)
        self.mask = illum > 0.3 * illum.max()
        self.truth_positions = np.asarray(self.truth.positions, dtype=np.float64)

    # -- metrics (positions in the reconstruction's object frame) -------------------------------
    def nrmse(self, obj, positions) -> float:
        from daskpty.metrics import nrmse, truth_frame

        est, cover, _ = truth_frame(obj, positions, np.ones(np.shape(obj), bool), self.truth.object,
                                    self.truth_positions)
        return float(nrmse(est, np.asarray(self.truth.object), mask=self.mask & cover))

    def nrmse_affine(self, obj, positions) -> float:
        from daskpty.metrics import nrmse
        from scipy.ndimage import map_coordinates

        a = affine_fit(self.truth_positions, positions)
        ty, tx = self.truth.object.shape
        yy, xx = np.meshgrid(np.arange(ty, dtype=np.float64), np.arange(tx, dtype=np.float64), indexing="ij")
        coords = np.c_[yy.ravel(), xx.ravel(), np.ones(yy.size)] @ a  # truth pixel -> reconstruction pixel
        obj = np.asarray(obj)
        def sample(part):
            return map_coordinates(part, coords.T, order=3, mode="constant", cval=1.0)

        est = (sample(obj.real.astype(np.float64)) + 1j * sample(obj.imag.astype(np.float64))).reshape(ty, tx)
        return float(nrmse(est, np.asarray(self.truth.object), mask=self.mask))

    def pos_errors(self, positions) -> tuple[float, float]:
        return (position_error(positions, self.truth_positions),
                position_error_affine(positions, self.truth_positions))

    def describe(self) -> str:
        rms, scale, rot = self.errors
        e0, e0a = self.pos_errors(self.nominal)
        return (f"data: {len(self.true)} patterns of {self.n}x{self.n}, object {self.shape}; nominal = true "
                f"x (1 + {scale:g}), rotated {rot:g} deg about the centre, + N(0, {rms:g} px) per axis: "
                f"position error {e0:.3f} px (offset removed), {e0a:.3f} px (affine removed); start probe: "
                f"{self.start_probe}")


def run_daskpty(case: Case, client, positions, *, engine="lsqml", epochs=50, refine=None, track=(),
                rounds_per_epoch=3, noise="gaussian", **kw) -> dict:
    """One daskpty reconstruction from the case's start (ones, data-derived probe).

    ``track``: epochs (1-based counts) after which the object and (with refinement) the refined
    positions are fetched. Returns rec, ``track`` {epoch: (object, positions)} in the object
    frame, the per-epoch seconds and the wall time."""
    import daskpty
    from types import SimpleNamespace

    track = set(int(e) for e in track)
    if refine is not None and track:
        track.add(epochs)  # the last one maps the chunks' pattern order to the user's
    snaps = {}

    def keep(epoch, state, metrics):
        if epoch in track:
            s = state.get()
            local = getattr(s, "chunk_local", None)
            pos = None
            if local:
                pos = np.concatenate([local[i]["positions"] for i in sorted(local)])
            snaps[epoch] = (np.array(s.object, copy=True), pos)

    keep.takes_epoch_state = True
    data = SimpleNamespace(intensities=case.data.intensities, positions=positions, mask=case.data.mask,
                           probe=None)
    t0 = time.perf_counter()
    rec = daskpty.reconstruct(data, engine=engine, epochs=epochs, object=case.object, probe=case.probe,
                              client=client, rounds_per_epoch=rounds_per_epoch, noise=noise,
                              callback=keep if track else None, rescale_probe=False,
                              refine_positions=refine if refine is not None else False, **kw)
    wall = time.perf_counter() - t0
    final_pos = np.asarray(rec.positions, dtype=np.float64)
    out = {}
    if snaps:
        perm = None
        if refine is not None:
            perm = _chunk_to_user(snaps[max(snaps)][1], final_pos)
        for e, (obj, pos) in sorted(snaps.items()):
            if refine is None or pos is None:  # fixed positions: the ones given, in the object frame
                pos = np.asarray(positions, dtype=np.float64) + np.asarray(rec.origin, dtype=np.float64)
            else:
                pos = pos[perm]
            out[e] = (obj, pos)
    seconds = np.array([h["seconds"] for h in rec.history])
    return {"rec": rec, "track": out, "seconds": seconds, "wall": wall, "positions": final_pos}


def _chunk_to_user(chunk_order, user_order):
    """Index array perm with chunk_order[perm] == user_order (rows matched exactly, else nearest)."""
    chunk_order = np.asarray(chunk_order)
    lookup = {row.tobytes(): i for i, row in enumerate(chunk_order)}
    perm = np.array([lookup.get(row.tobytes(), -1) for row in np.asarray(user_order)])
    if (perm < 0).any() or len(set(perm.tolist())) != len(perm):
        from scipy.spatial import cKDTree

        perm = cKDTree(chunk_order).query(user_order)[1]
    return perm


def median_seconds(seconds, start=1) -> float:
    s = np.asarray(seconds)
    return float(np.median(s[start:] if len(s) > start else s))


def fastest_seconds(seconds, start=1, fraction=0.2) -> float:
    """Mean of the fastest ``fraction`` of the epochs from ``start`` on: a machine whose
    neighbours steal time only ever adds to an epoch, so the fastest epochs show what the work
    itself costs (the median carries the neighbours too)."""
    s = np.sort(np.asarray(seconds)[start:] if len(seconds) > start else np.asarray(seconds))
    return float(s[:max(1, int(round(fraction * len(s))))].mean())
