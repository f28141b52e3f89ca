"""The dashboard's pictures, made on the client: block-mean downsampling of the object, probe and
per-pattern maps, and a minimal 8-bit greyscale PNG encoder (zlib only), so an epoch's update
to the scheduler is a few KB (see :class:`daskpty.monitor.dashboard.DashboardPublisher`)."""
from __future__ import annotations

import struct
import zlib

import numpy as np
from scipy.spatial import cKDTree

from ..io.results import is_lazy
from ..physics import get_xp, to_numpy


def downsample(a, max_size: int) -> np.ndarray:
    """Block-mean of a 2-D (NumPy or CuPy) array so that both sides are ≤ ``max_size``.

    One integer factor for both axes (square pixels stay square); trailing rows/columns that do
    not fill a block are dropped. Works in slabs, so the temporary memory stays small even for a
    multi-GiB object; only the small result is copied to the host.
    """
    H, W = a.shape
    f = max(1, -(-max(H, W) // int(max_size)))
    if f == 1:
        return np.array(to_numpy(np.asarray(a) if is_lazy(a) else a))
    fy, fx = min(f, H), min(f, W)
    h, w = H // fy, W // fx
    if is_lazy(a):  # a dask array (a large tiled object): block means where its tiles are
        import dask.array as da

        cut = a[:h * fy, :w * fx]
        cut = cut.rechunk((fy * max(1, cut.chunks[0][0] // fy), fx * max(1, min(w * fx, 4096) // fx)))
        return np.asarray(da.coarsen(np.mean, cut, {0: fy, 1: fx}).compute())
    rows = max(1, (1 << 22) // max(1, fy * W))      # output rows per slab (~4 M input elements)
    out = []
    for r in range(0, h, rows):
        r1 = min(h, r + rows)
        slab = a[r * fy:r1 * fy, :w * fx].reshape(r1 - r, fy, w, fx)
        out.append(to_numpy(slab.mean(axis=(1, 3))))
    return np.concatenate(out, axis=0)


def encode_png(gray: np.ndarray) -> bytes:
    """8-bit greyscale PNG of a (h, w) uint8 array (no dependencies beyond zlib)."""
    gray = np.ascontiguousarray(gray, dtype=np.uint8)
    h, w = gray.shape
    raw = np.zeros((h, w + 1), dtype=np.uint8)       # filter byte 0 (None) per row
    raw[:, 1:] = gray

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
            + chunk(b"IEND", b""))


def _to_uint8(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if not hi > lo:
        hi = lo + 1.0
    y = (np.nan_to_num(x, nan=lo) - lo) * (255.0 / (hi - lo))
    return np.clip(y, 0, 255).astype(np.uint8)


def _robust_range(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0, 1.0
    lo, hi = np.percentile(x, [1.0, 99.0])
    return float(lo), float(hi)


def object_images(obj, illumination=None, size: int = 128) -> dict:
    """Downsampled phase and amplitude of the object as PNGs plus their display ranges.

    The complex object is block-averaged, its global phase (the phase of the sum over the
    illuminated region) removed, and each image scaled to its 1st–99th percentile over the
    illuminated region (``illumination > 10 % of max``; everything when unknown). A multislice
    object (K, H, W) is shown projected: the product of its slices (phase = sum of the slices'
    phases), masked by the entrance slice's illumination.
    """
    if np.ndim(obj) == 3:
        obj = obj.prod(axis=0) if is_lazy(obj) else np.prod(np.asarray(obj), axis=0)
        if illumination is not None and np.ndim(illumination) == 3:
            illumination = illumination[0] if is_lazy(illumination) else np.asarray(illumination)[0]
    small = downsample(obj, size).astype(np.complex64)
    mask = None
    if illumination is not None and tuple(illumination.shape) == tuple(obj.shape):
        ill = downsample(illumination, size).astype(np.float32)
        if ill.shape == small.shape and float(ill.max()) > 0:
            mask = ill > 0.1 * float(ill.max())
    if mask is None or not mask.any():
        mask = np.ones(small.shape, dtype=bool)
    ref = complex(small[mask].sum())
    if abs(ref) > 0:
        small = small * np.complex64(np.conj(ref) / abs(ref))
    phase = np.angle(small).astype(np.float32)
    amplitude = np.abs(small).astype(np.float32)
    phase_range = _robust_range(phase[mask])
    amplitude_range = _robust_range(amplitude[mask])
    return {
        "shape": [int(s) for s in obj.shape],
        "image_shape": [int(s) for s in small.shape],
        "phase_range": list(phase_range),
        "amplitude_range": list(amplitude_range),
        "phase_png": encode_png(_to_uint8(phase, *phase_range)),
        "amplitude_png": encode_png(_to_uint8(amplitude, *amplitude_range)),
    }


def probe_images(probe, size: int = 64) -> dict:
    """Per-mode amplitude PNGs (each scaled to its own maximum) and power fractions."""
    xp = get_xp(probe)
    if probe.ndim == 2:
        probe = probe[None]
    power = to_numpy(xp.sum(xp.abs(probe) ** 2, axis=(-2, -1))).astype(np.float64)
    total = float(power.sum())
    fractions = [float(p / total) if total > 0 else float("nan") for p in power]
    pngs = []
    for k in range(probe.shape[0]):
        amp = downsample(xp.abs(probe[k]), size).astype(np.float32)
        pngs.append(encode_png(_to_uint8(amp, 0.0, float(amp.max()) if amp.size else 1.0)))
    return {"modes": int(probe.shape[0]), "shape": [int(s) for s in probe.shape[-2:]],
            "power_fractions": fractions, "pngs": pngs}


def scan_map(nominal, values, size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Per-pattern values (B,) or (B, K) as images over the scan, at most ``size`` pixels a side:
    each pixel takes the value of the nearest pattern, if one lies within the scan's typical
    spacing (the median distance between nearest neighbours). Returns ``(images, covered)``:
    images (h, w) or (K, h, w), covered (h, w)."""
    nominal = np.asarray(nominal, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    lo, hi = nominal.min(axis=0), nominal.max(axis=0)
    extent = np.maximum(hi - lo, 1e-9)
    scale = (size - 1) / extent.max()
    shape = tuple(int(v) for v in np.ceil(extent * scale) + 1)
    pixels = np.indices(shape).reshape(2, -1).T / scale + lo
    tree = cKDTree(nominal)
    spacing = float(np.median(tree.query(nominal, 2)[0][:, 1])) if len(nominal) > 1 else 0.0
    distance, nearest = tree.query(pixels)
    covered = (distance <= max(spacing, 0.5 / scale) + 1e-9).reshape(shape)
    picked = np.moveaxis(values[nearest], 0, -1).reshape(values.shape[1:] + shape)
    return np.where(covered, picked, 0.0), covered


def position_images(nominal, moved, size: int = 128) -> dict:
    """The distance each pattern moved from its nominal position, as a grey map over the scan
    (:func:`scan_map`; black = not moved or no pattern near)."""
    distance = np.hypot(*np.asarray(moved, dtype=np.float64).T)
    mean, _ = scan_map(nominal, distance, size)
    top = float(distance.max()) if distance.size else 0.0
    return {"png": encode_png(_to_uint8(mean, 0.0, top if top > 0 else 1.0)), "max_moved": top,
            "rms_moved": float(np.sqrt(np.mean(distance ** 2))) if distance.size else 0.0,
            "image_shape": list(mean.shape), "patterns": int(distance.size)}


def opr_images(eigen_probes, nominal, weights, size: int = 128, probe_size: int = 64) -> dict:
    """A varying probe (OPR): the eigen-probes' amplitudes (U_1 … U_{K−1}; U_0 is the probe's
    mode 0) and each weight w_k as a grey map over the scan, black to white over its own range
    across the patterns (pixels no pattern falls in: black)."""
    weights = np.asarray(weights, dtype=np.float64)
    eigen = probe_images(eigen_probes, probe_size) if eigen_probes is not None and len(eigen_probes) else None
    images, covered = scan_map(nominal, weights, size)          # (K, h, w): one lookup for all
    maps, ranges = [], []
    for image, column in zip(images, weights.T):
        lo, hi = float(column.min()), float(column.max())
        gray = _to_uint8(image, lo, hi if hi > lo else lo + 1.0)
        gray[~covered] = 0
        maps.append(encode_png(gray))
        ranges.append([lo, hi])
    return {"modes": int(weights.shape[1]), "eigen_pngs": [] if eigen is None else eigen["pngs"],
            "weight_pngs": maps, "weight_ranges": ranges, "image_shape": list(covered.shape),
            "patterns": int(len(weights))}
