"""Validation of daskpty data sets: structural checks (cheap) and value checks (one pass).

Every problem raises :class:`DataError` with one line that names the problem and the fix.
Structural checks look at attributes, shapes, dtypes and the (small) positions array; they run
whenever a data set is opened or built. Value checks read every intensity once (a dask reduction)
and run on request: ``open_data(path, validate="full")``, :func:`check_values`, ``daskpty info --check``.

NumPy only at import time; dask is imported inside :func:`check_values`.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..faults import DataError  # noqa: F401 (also named here)
from .dask_client import current_client
from .safety import FORMAT_VERSIONS
from .scan import unit_mistake

FORMAT_NAME = "daskpty-dataset"
FORMAT_VERSION = FORMAT_VERSIONS[FORMAT_NAME]
INTENSITY_DTYPES = (np.dtype("uint16"), np.dtype("uint32"), np.dtype("float32"))
GEOMETRY_KEYS = ("wavelength_m", "detector_distance_m", "detector_pixel_size_m", "object_pixel_size_m")
#: further geometry keys (thick samples, electrons, near field; docs/data-format.md), each None or > 0
PHYSICS_KEYS = ("focus_to_sample_m", "electron_voltage_v", "reciprocal_pixel_rad", "convergence_semiangle_rad")
#: values of the ``detector`` key: which operator takes the exit wave to the detector
DETECTORS = ("far_field", "near_field")
#: accelerating voltages accepted for electrons, volts (= daskpty.physics.geometry's; io stays below physics)
ELECTRON_VOLTAGE_RANGE_V = (1e3, 3e6)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def fail(msg: str):
    raise DataError(_one_line(msg))


# --------------------------------------------------------------------------- store attributes

def check_format_attrs(attrs, where: str) -> None:
    """Check the ``daskpty`` format marker of a store's root attributes."""
    marker = attrs.get("daskpty") if hasattr(attrs, "get") else None
    if not isinstance(marker, dict) or "format" not in marker:
        fail(f"{where} is a Zarr group but not a daskpty data set (no 'daskpty' format attribute); "
             f"create one with daskpty.from_arrays(...).to_zarr(path) or 'daskpty simulate'")
    fmt = marker.get("format")
    if fmt != FORMAT_NAME:
        fail(f"{where} is a '{fmt}' store, not a '{FORMAT_NAME}'; pass the path of a data set store")
    version = marker.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        fail(f"{where} has an invalid format version {version!r}; rewrite the store with this daskpty")
    if version > FORMAT_VERSION:
        fail(f"{where} was written in data-set format version {version}, newer than the version "
             f"{FORMAT_VERSION} this daskpty reads; upgrade daskpty")


def check_geometry(meta: dict) -> None:
    """Geometry values must be None or positive finite numbers; an electron voltage within
    :data:`ELECTRON_VOLTAGE_RANGE_V`; ``detector`` None or one of :data:`DETECTORS`."""
    for key in GEOMETRY_KEYS + PHYSICS_KEYS:
        v = meta.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(v)) or float(v) <= 0:
            unit = {"electron_voltage_v": "volts"}.get(key, "radians" if key.endswith("_rad") else "metres")
            fail(f"metadata '{key}' is {v!r}; give a positive number in {unit} or None")
    volts = meta.get("electron_voltage_v")
    lo, hi = ELECTRON_VOLTAGE_RANGE_V
    if volts is not None and not lo <= float(volts) <= hi:
        hint = f" (give volts: {float(volts):g} kV is {float(volts) * 1e3:g})" if float(volts) < lo else ""
        fail(f"electron voltage {float(volts):g} V is outside {lo:g} V ... {hi:g} V{hint}")
    detector = meta.get("detector")
    if detector is not None and detector not in DETECTORS:
        fail(f"metadata 'detector' is {detector!r}; use one of {', '.join(DETECTORS)} or None")


# --------------------------------------------------------------------------- shapes and dtypes

def refuse_objects(dtype, where: str, option: str) -> None:
    """Refuse an array of Python objects: reading one would unpickle (run) code from the file,
    which daskpty never does. The line names the file (``where``) and the option it came from."""
    if np.dtype(dtype).hasobject:
        fail(f"{where} ({option}) holds Python objects (dtype {np.dtype(dtype)}), which daskpty never "
             f"loads (reading them would run pickled code); save it as a numeric array, e.g. "
             f"numpy.save(path, numpy.asarray(values, dtype=numpy.float32))")


def npy_dtype(path, member: str | None = None) -> np.dtype | None:
    """The dtype in the header of the ``.npy`` file ``path``, or of the member ``member`` (e.g.
    ``"positions.npy"``) of the ``.npz`` archive ``path``, read without loading the array; None
    when there is no such header (the loader then says what is wrong)."""
    import zipfile

    try:
        if member is None:
            with open(path, "rb") as fh:
                return _npy_header_dtype(fh)
        with zipfile.ZipFile(path) as zf, zf.open(member) as fh:
            return _npy_header_dtype(fh)
    except (OSError, ValueError, KeyError, SyntaxError, zipfile.BadZipFile):
        return None


def _npy_header_dtype(fh) -> np.dtype:
    version = np.lib.format.read_magic(fh)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    return np.dtype(read(fh)[2])


def check_intensity_layout(shape, dtype) -> None:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3:
        fail(f"intensities have shape {shape}; expected (N, H, W): one 2-D pattern per scan position")
    dtype = np.dtype(dtype)
    if dtype not in INTENSITY_DTYPES:
        fail(f"intensities have dtype {dtype}; expected uint16, uint32 or float32 "
             f"(convert with .astype(numpy.float32) or .astype(numpy.uint32))")
    n, h, w = shape
    if n == 0:
        fail("the data set is empty (0 patterns); record or simulate at least one pattern")
    if h == 0 or w == 0:
        fail(f"patterns have shape {(h, w)}; expected non-empty square patterns")
    if h != w:
        fail(f"patterns are {h} x {w}; daskpty needs square patterns, crop or pad them to n x n")


def check_positions(positions, n_patterns: int):
    """Return positions as (N, 2) float64, or raise DataError."""
    positions = np.asarray(positions)
    if positions.dtype.kind not in "fiu":
        fail(f"positions have dtype {positions.dtype}; expected real numbers (float64 object pixels)")
    if positions.ndim != 2 or positions.shape[1] != 2:
        fail(f"positions have shape {positions.shape}; expected (N, 2) with columns (y, x) in "
             f"object pixels")
    if positions.shape[0] != n_patterns:
        fail(f"there are {n_patterns} patterns but {positions.shape[0]} positions; "
             f"give exactly one (y, x) position per pattern")
    positions = positions.astype(np.float64, copy=False)
    bad = ~np.isfinite(positions).all(axis=1)
    if bad.any():
        idx = np.flatnonzero(bad)
        fail(f"{idx.size} position(s) are NaN or infinite (first at pattern {int(idx[0])}); "
             f"fix or drop those patterns and their positions")
    return positions


def check_position_scale(positions, pattern_size: int, *, units: str | None = None,
                         pixel_m: float | None = None) -> None:
    """Refuse positions (object pixels) whose scale says a unit mistake: a scan far below one
    probe width or steps of many probe widths (:func:`daskpty.io.scan.unit_mistake`)."""
    problem = unit_mistake(positions, int(pattern_size), units=units, pixel_m=pixel_m)
    if problem:
        fail(problem)


def check_mask(mask, pattern_shape):
    """Return the mask as a bool (H, W) array, or raise DataError."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.shape != tuple(pattern_shape):
        fail(f"mask has shape {mask.shape} but patterns are {tuple(pattern_shape)}; give one "
             f"boolean per detector pixel (True = valid)")
    if mask.dtype != np.bool_:
        if mask.dtype.kind in "iu" and np.isin(mask, (0, 1)).all():
            mask = mask.astype(bool)
        else:
            fail(f"mask has dtype {mask.dtype}; expected bool (True = valid pixel), "
                 f"convert with mask.astype(bool)")
    if not mask.any():
        fail("the mask marks no detector pixel as valid; True means 'valid pixel'")
    return mask


def check_probe(probe, pattern_shape, what: str = "probe"):
    """Return the probe as complex64 (M, H, W), or raise DataError."""
    if probe is None:
        return None
    probe = np.asarray(probe)
    if probe.ndim == 2:
        probe = probe[None]
    if probe.ndim != 3 or probe.shape[0] == 0 or probe.shape[1:] != tuple(pattern_shape):
        fail(f"{what} has shape {probe.shape} but patterns are {tuple(pattern_shape)}; "
             f"expected (modes, H, W) matching the detector")
    if probe.dtype.kind not in "fc":
        fail(f"{what} has dtype {probe.dtype}; expected complex64")
    probe = probe.astype(np.complex64, copy=False)
    if not np.isfinite(probe.view(np.float32)).all():
        fail(f"{what} contains NaN or infinite values; replace the initial guess")
    if not np.abs(probe).any():
        fail(f"{what} is all zeros; store a non-zero initial guess or none at all (daskpty then "
             f"derives one from the data)")
    return probe


# --------------------------------------------------------------------------- value checks

@dataclasses.dataclass
class ValueReport:
    """Counts from one pass over the intensities (see :func:`check_values`)."""

    n_values: int
    n_nan: int = 0
    n_inf: int = 0
    n_negative: int = 0
    minimum: float = math.nan
    maximum: float = math.nan
    total: float = 0.0
    first_bad_pattern: int | None = None

    @property
    def no_counts(self) -> bool:
        """Every intensity is zero: nothing was measured (a wrong dataset, a dark frame, a mask)."""
        return self.n_values > 0 and self.maximum == 0

    @property
    def ok(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0 and self.n_negative == 0 and not self.no_counts

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d

    def raise_if_bad(self) -> None:
        if self.ok:
            return
        if self.n_nan == self.n_inf == self.n_negative == 0:  # so: no counts
            fail(f"the intensities are all zero: the data set has no counts in any of its "
                 f"{self.n_values:,} values, so there is nothing to reconstruct from; check that "
                 f"the right detector dataset was imported (--data) and that the dark / "
                 f"background subtraction or the mask did not remove everything")
        parts = []
        if self.n_nan:
            parts.append(f"{self.n_nan} NaN")
        if self.n_inf:
            parts.append(f"{self.n_inf} infinite")
        if self.n_negative:
            parts.append(f"{self.n_negative} negative")
        fail(f"intensities contain {', '.join(parts)} value(s) (first in pattern "
             f"{self.first_bad_pattern}); replace them (e.g. with 0) and mark those detector pixels "
             f"invalid in the mask")


def _block_stats(block, numbers):
    """Per-chunk counts: (nan, inf, negative, min, max, sum, first bad pattern or -1).

    ``numbers``: the pattern number of the block's first row (rows numbered on from it), or
    each row's number. NumPy or CuPy blocks (the sums come back as Python numbers)."""
    xp = np if type(block).__module__.split(".")[0] == "numpy" else __import__("cupy")
    block = xp.asarray(block)
    n_nan = n_inf = n_neg = 0
    bad_rows = None
    if block.dtype.kind == "f":
        nan = xp.isnan(block)
        inf = xp.isinf(block)
        neg = (block < 0) & ~inf  # -inf counts as infinite only
        n_nan, n_inf, n_neg = int(nan.sum()), int(inf.sum()), int(neg.sum())
        if n_nan or n_inf or n_neg:
            rows = xp.flatnonzero((nan | inf | neg).any(axis=(1, 2)))
            bad_rows = rows if xp is np else rows.get()
        finite = block[xp.isfinite(block)] if (n_nan or n_inf) else block
    else:
        finite = block
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
        total = float(finite.sum(dtype=np.float64))
    else:
        lo, hi, total = math.inf, -math.inf, 0.0
    first = -1
    if bad_rows is not None and bad_rows.size:
        first = int(np.min(np.asarray(numbers)[bad_rows])) if np.ndim(numbers) else int(numbers + bad_rows[0])
    return (n_nan, n_inf, n_neg, lo, hi, total, first)


def check_values(data, client=None, order=None, where: str | None = None) -> ValueReport:
    """Count NaN, infinite and negative intensities, and the min/max/sum, in one pass.

    ``data`` is a :class:`~daskpty.io.store.PtychoData` or a dask/NumPy array (N, H, W), with
    NumPy or CuPy chunks (data already placed on GPU workers are checked where they are). Runs on
    ``client`` if given, else on the current distributed client, else on dask's local threads.
    ``order``: the user's pattern number of each row, for data held in another order (the first
    bad pattern is then named by its number in the data set). ``where``: the data set's name in
    messages (default: its path, else "the data set"). Returns a :class:`ValueReport`;
    call ``report.raise_if_bad()`` to turn problems into a DataError.
    """
    return check_values_and(data, (), client=client, order=order, where=where)[0]


def check_values_and(data, extra, client=None, order=None, where: str | None = None):
    """:func:`check_values` and the dask collections ``extra`` (built on the same intensities)
    computed in the same pass: each chunk is read once for both. Returns (report, their values)."""
    import dask  # lazy: dask stays out of `import daskpty` and the CLI's start
    import dask.array as da

    x = getattr(data, "intensities", data)
    if not isinstance(x, da.Array):
        x = da.from_array(np.asarray(x), chunks=(max(1, min(len(x), 1024)), -1, -1))
    if x.ndim != 3:
        fail(f"intensities have shape {x.shape}; expected (N, H, W)")
    x = x.rechunk({1: -1, 2: -1})
    offsets = np.concatenate([[0], np.cumsum(x.chunks[0])[:-1]])
    # unoptimised graphs: fusing the reads into each consumer would read a chunk once per consumer
    shared = {"optimize_graph": False} if extra else {}
    blocks = x.to_delayed(**shared).ravel()
    numbers = [int(o) if order is None else np.asarray(order[o:o + len_])
               for o, len_ in zip(offsets, x.chunks[0])]
    parts = [dask.delayed(_block_stats, pure=True)(b, k) for b, k in zip(blocks, numbers)]
    extra = list(extra)
    if client is None:
        client = current_client()
    try:
        if client is not None:
            results = client.gather(client.compute(parts + extra, **shared))
        else:
            results = list(dask.compute(*parts, *extra, scheduler="threads", **shared))
    except DataError:  # a damaged shard, already named by io.integrity.NamedReader
        raise
    except (ValueError, RuntimeError, OSError, KeyError) as exc:  # zarr / numcodecs decode errors
        where = where or getattr(data, "path", None) or "the data set"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        fail(f"could not read the intensities of {where}: a chunk is damaged ({type(exc).__name__}: "
             f"{first[:200]}); re-copy or re-create the store")
    results, computed = results[:len(parts)], results[len(parts):]
    report = ValueReport(n_values=int(np.prod(x.shape)))
    firsts = [r[6] for r in results if r[6] >= 0]
    report.n_nan = sum(r[0] for r in results)
    report.n_inf = sum(r[1] for r in results)
    report.n_negative = sum(r[2] for r in results)
    lo = min(r[3] for r in results)
    hi = max(r[4] for r in results)
    report.minimum = lo if math.isfinite(lo) else math.nan
    report.maximum = hi if math.isfinite(hi) else math.nan
    report.total = float(sum(r[5] for r in results))
    report.first_bad_pattern = min(firsts) if firsts else None
    return report, computed
