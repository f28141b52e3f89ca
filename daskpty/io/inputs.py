"""Sanity of a reconstruction's inputs, checked before any cluster starts.

* the data set (a path or an opened one): intensities' layout, positions' shape, finiteness
  and duplicates, one position per pattern; the initial probe; a store to resume from;
* positions whose scale says a unit mistake (metres as micrometres or pixels);
* positions far outside the scan's bulk (a robust median / MAD test per axis), which would make
  the default object frame huge;
* objects that would not fit this machine's memory (the client holds a few object-sized arrays);
* non-finite initial objects; more minibatch rounds than patterns;
* settings of a resumed run that differ from the store's (chunking, rounds, fan-in), which would
  break the bit-identity of resume.

Plain NumPy; every refusal is one ``ValueError`` line naming the patterns or the setting.
"""
from __future__ import annotations

import os
import warnings

import numpy as np

from .results import Reconstruction
from .store import open_data
from .validate import check_intensity_layout, check_position_scale

#: a position is an outlier when it lies more than OUTLIER_MADS robust standard deviations
#: (1.4826 MAD) plus two probe widths from the median along y or x
OUTLIER_MADS = 20.0
#: object-sized arrays the client holds at once (object, update, illumination, momentum, copy)
OBJECT_COPIES = 6
_SHOWN = 5


def position_outliers(positions: np.ndarray, n: int) -> np.ndarray:
    """Indices of positions far outside the scan's bulk (robust: median and MAD per axis)."""
    p = np.asarray(positions, dtype=np.float64)
    if p.ndim != 2 or len(p) < 4:
        return np.zeros(0, dtype=np.int64)
    median = np.median(p, axis=0)
    sigma = 1.4826 * np.median(np.abs(p - median), axis=0)
    limit = OUTLIER_MADS * sigma + 2.0 * n
    return np.flatnonzero((np.abs(p - median) > limit).any(axis=1))


def check_positions_bulk(positions: np.ndarray, n: int) -> None:
    """Refuse positions far outside the scan's bulk, naming the patterns, and a scan whose scale
    says the units are wrong (:func:`daskpty.io.validate.check_position_scale`)."""
    check_position_scale(positions, n)
    bad = position_outliers(positions, n)
    if len(bad) == 0:
        return
    p = np.asarray(positions, dtype=np.float64)
    good = np.delete(p, bad, axis=0)
    lo, hi = good.min(axis=0), good.max(axis=0)
    shown = ", ".join(f"{j} at (y, x) = ({p[j, 0]:.6g}, {p[j, 1]:.6g})" for j in bad[:_SHOWN])
    more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    raise ValueError(f"{len(bad)} scan position(s) lie far outside the scan: pattern {shown}{more}, "
                     f"while the other {len(good)} span y {lo[0]:.1f}..{hi[0]:.1f}, x "
                     f"{lo[1]:.1f}..{hi[1]:.1f} px (median/MAD test); fix or drop those patterns")


def memory_bytes() -> int:
    """Physical memory of this machine (0 when unknown)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return 0


def check_object_size(shape, positions: np.ndarray, n: int, given: bool) -> None:
    """Refuse an object whose working copies would not fit this machine's memory."""
    pixels = int(np.prod([int(s) for s in shape]))
    need = pixels * 8 * OBJECT_COPIES
    total = memory_bytes()
    if not total or need <= total:
        return
    p = np.asarray(positions, dtype=np.float64)
    extent = p.max(axis=0) - p.min(axis=0) if len(p) else np.zeros(2)
    source = "the given object is" if given else "the object covering the scan would be"
    raise ValueError(f"{source} {shape[0]} x {shape[1]} pixels ({pixels * 8 / 2**30:.1f} GiB, "
                     f"about {need / 2**30:.0f} GiB while reconstructing) for a scan extent of "
                     f"{extent[0]:.0f} x {extent[1]:.0f} px, more than this machine's "
                     f"{total / 2**30:.0f} GiB; check the positions' units (object pixels) or "
                     f"reconstruct a smaller region")


def check_initial_object(obj: np.ndarray) -> None:
    """Refuse an initial object with NaN or infinite values (as the probe is), or all zeros
    (every exit wave would be zero: no phase to update from, no probe update)."""
    finite = np.isfinite(obj)
    if not finite.all():
        idx = np.unravel_index(int(np.argmin(finite)), obj.shape)
        raise ValueError(f"the initial object contains {int(obj.size - finite.sum())} NaN or "
                         f"infinite values (the first at pixel {tuple(int(i) for i in idx)}); pass "
                         f"a finite initial object or leave object=None")
    if not obj.any():
        raise ValueError(f"the initial object ({' x '.join(str(s) for s in obj.shape)}) is all "
                         f"zeros: its exit waves are zero, so there is no phase to update from; "
                         f"pass object=None for the default start (ones) or a non-zero guess")


def check_rounds(rounds_per_epoch, n_patterns: int) -> None:
    """Each minibatch round needs at least one pattern."""
    if rounds_per_epoch != "auto" and int(rounds_per_epoch) > n_patterns:
        raise ValueError(f"rounds_per_epoch={rounds_per_epoch} exceeds the {n_patterns} patterns "
                         f"(each round updates from a slice of them); use at most {n_patterns} "
                         f"or 'auto'")


RESUMED_SETTINGS = ("chunk_length", "rounds_per_epoch", "split_every")
#: the command-line flags of the settings a resumed run reuses (named in the warning)
RESUMED_FLAGS = {"chunk_length": "--chunk-length", "rounds_per_epoch": "--rounds-per-epoch",
                 "split_every": "--split-every", "tiles": "--tiles"}


def resume_settings(stored: dict, **given) -> dict:
    """The settings a resumed run must reuse to stay bit-identical: the stored value where the
    caller left it to daskpty (None / "auto"), else the given one with a warning if it differs."""
    out = dict(given)
    for name, value in given.items():
        kept = (stored or {}).get(name)
        if kept is None:
            continue
        if value is None or value == "auto":
            out[name] = kept
        elif value != kept:
            warnings.warn(f"{name}={value} differs from the {name}={kept} of the resumed store; "
                          f"the result will not be bit-identical to an uninterrupted run (leave "
                          f"{name} unset{_cli_flag(name)} to reuse the store's)", UserWarning, stacklevel=3)
    return out


def _cli_flag(name: str) -> str:
    flag = RESUMED_FLAGS.get(name)
    return f" (CLI: drop {flag})" if flag else ""


def load_data(data):
    """A data set: ``data`` itself, or the store at the path ``data``."""
    if isinstance(data, (str, os.PathLike)):
        return open_data(data)
    for attr in ("intensities", "positions"):
        if not hasattr(data, attr):
            raise TypeError("data must be a path to a daskpty store or a PtychoData "
                            "(see daskpty.open_data / daskpty.from_arrays)")
    return data


def check_initial_probe(probe, n):
    """The initial probe as (modes, n, n) complex64, or one line saying what is wrong with it."""
    probe = np.asarray(probe, dtype=np.complex64)
    if probe.ndim == 2:
        probe = probe[None]
    if probe.ndim != 3 or probe.shape[-2:] != (n, n):
        raise ValueError(f"probe shape {probe.shape} does not match the detector shape ({n}, {n}); "
                         f"pass a probe of shape (n, n) or (modes, n, n) with n the pattern size")
    if not np.isfinite(probe).all():
        raise ValueError("the probe contains NaN or infinite values; pass a finite initial probe")
    if not np.abs(probe).any():
        raise ValueError("the probe is all zeros; pass a non-zero initial probe or leave probe=None "
                         "to derive one from the data")
    return probe


def check_scan(positions, n: int = 0):
    """Refuse positions of the wrong shape, non-finite, duplicated or far outside the scan."""
    if positions.ndim != 2 or positions.shape[1] != 2:
        raise ValueError(f"positions must have shape (N, 2), got {positions.shape}")
    if not np.isfinite(positions).all():
        raise ValueError("positions contain NaN or infinite values; fix or drop those patterns")
    unique = np.unique(positions, axis=0)
    if len(unique) < len(positions):
        raise ValueError(f"{len(positions) - len(unique)} scan positions are exact duplicates; "
                         "remove repeated patterns or average them before reconstructing")
    check_positions_bulk(positions, n)  # one position at 1e9 would ask for a 1e9-pixel object


def checked_data(data):
    """The opened data set, its intensities and its positions (float64), or one clear error."""
    data = load_data(data)
    intensities = data.intensities
    check_intensity_layout(tuple(intensities.shape), np.dtype(intensities.dtype))
    positions = np.asarray(data.positions, dtype=np.float64)
    check_scan(positions, intensities.shape[-1])
    if len(positions) == 0 or intensities.shape[0] == 0:
        raise ValueError("the data set is empty; there is nothing to reconstruct")
    if intensities.shape[0] != len(positions):
        raise ValueError(f"{intensities.shape[0]} patterns but {len(positions)} positions; "
                         "they must match one to one")
    return data, intensities, positions


def resumed_store(path, positions, n, probe_modes=None):
    """The reconstruction store at ``path`` to resume from, refused when it does not fit the data
    (positions, the probe's field: (modes, n, n)) or the run (``probe_modes`` given and not the
    stored count: :func:`check_resumed_modes`)."""
    rec = Reconstruction.from_zarr(path)
    nominal = rec.positions if rec.nominal_positions is None else rec.nominal_positions
    if nominal.shape != positions.shape or not np.allclose(nominal - rec.origin, positions,
                                                                  atol=1e-6):
        raise ValueError(f"the resume store {path} does not match the data: its positions differ; "
                         "resume with the data set it was made from")
    shape = tuple(np.shape(rec.probe))
    if len(shape) != 3 or shape[-2:] != (n, n) or shape[0] < 1:
        size = f"has a {shape[-1]}-pixel probe" if len(shape) == 3 and shape[-1] != n else \
            f"holds a probe of shape {shape}"
        raise ValueError(f"the resume store {path} {size} but the data have {n}-pixel patterns (its "
                         f"field 'probe' must be (modes, {n}, {n})); resume with the data set it was "
                         f"made from, or start afresh without resuming")
    check_resumed_modes(path, shape[0], probe_modes)
    return rec


def check_resumed_modes(path, stored: int, asked) -> None:
    """Refuse ``probe_modes`` that differ from a resumed store's probe modes. Refused rather than
    followed: the stored engine state (momentum, eigen-probes, optimiser moments) is shaped by
    the modes, so more or fewer of them make a new reconstruction, not a continued one; the
    line says how to get either."""
    if asked is None or int(asked) == int(stored):
        return
    modes = "mode" if stored == 1 else "modes"
    raise ValueError(f"the checkpoint {path} holds {stored} probe {modes}; probe_modes={asked} "
                     f"(--probe-modes {asked}) asks for {asked}: drop it to resume with {stored}, "
                     f"or start afresh without resuming (CLI: --overwrite instead of --resume)")


__all__ = ["check_initial_object", "check_initial_probe", "check_resumed_modes", "check_object_size", "check_positions_bulk",
           "check_rounds", "check_scan", "checked_data", "load_data", "position_outliers", "resume_settings",
           "resumed_store"]
