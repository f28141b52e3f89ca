"""Array-namespace helpers: one code path for NumPy (CPU) and CuPy (GPU) arrays.

Nothing here imports dask. CuPy is optional and imported lazily.
"""
from __future__ import annotations

import os

import numpy as np
import scipy.fft

from . import fftw

_FFT_WORKERS = int(os.environ.get("DASKPTY_FFT_WORKERS", "1"))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


#: The FFT-level optimisations, each on by default and switchable for the ablation benchmark
#: (benchmarks/bench_ablation.py) through the environment of the worker processes:
#: ``DASKPTY_FFT_BATCHED=0`` transforms one 2-D pattern at a time instead of one batched call;
#: ``DASKPTY_FFT_INPLACE=0`` never lets a transform reuse its input's memory;
#: ``DASKPTY_CUFFT_PLAN_CACHE=0`` empties CuPy's cuFFT plan cache (a new plan for every call).
FFT_SETTINGS = {"batched": _env_flag("DASKPTY_FFT_BATCHED"), "inplace": _env_flag("DASKPTY_FFT_INPLACE"),
                "plan_cache": _env_flag("DASKPTY_CUFFT_PLAN_CACHE")}
_PLAN_CACHE_SET = False


def set_fft_workers(n: int) -> None:
    """Set the number of threads scipy.fft uses for batched CPU FFTs (default 1, or the
    ``DASKPTY_FFT_WORKERS`` environment variable).

    One thread per FFT suits the usual layout of one dask worker thread per core, where chunks
    already run in parallel; raise it for a worker with several threads and few chunks.
    """
    global _FFT_WORKERS
    _FFT_WORKERS = max(1, int(n))


def get_fft_workers() -> int:
    return _FFT_WORKERS


def get_xp(*arrays):
    """Return the array module (``numpy`` or ``cupy``) of the first CuPy array, else NumPy."""
    for a in arrays:
        if type(a).__module__.split(".")[0] == "cupy":
            import cupy  # lazy: optional GPU dependency

            return cupy
    return np


def is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def to_numpy(a):
    """Copy a CuPy array to host; return NumPy arrays unchanged."""
    if is_cupy(a):
        return a.get()
    return np.asarray(a)


def asarray_like(a, like):
    """Move ``a`` to the device/namespace of ``like``."""
    xp = get_xp(like)
    if xp is np:
        return to_numpy(a)
    return xp.asarray(a)


def _transform(a, inverse: bool, overwrite: bool):
    overwrite = overwrite and FFT_SETTINGS["inplace"]
    if is_cupy(a):
        _apply_plan_cache_setting()
        if overwrite and a.flags.c_contiguous:  # cuFFT may then write the result into ``a``
            import cupyx.scipy.fft as cufft  # lazy: optional GPU dependency

            return (cufft.ifft2 if inverse else cufft.fft2)(a, norm="ortho", overwrite_x=True)
        import cupy  # lazy: optional GPU dependency

        return (cupy.fft.ifft2 if inverse else cupy.fft.fft2)(a, norm="ortho")
    out = fftw.transform(a, inverse, overwrite, _FFT_WORKERS)   # FFTW when pyFFTW is installed
    if out is not None:
        return out
    return (scipy.fft.ifft2 if inverse else scipy.fft.fft2)(a, norm="ortho", workers=_FFT_WORKERS,
                                                          overwrite_x=overwrite)


def _per_pattern(a, inverse: bool, overwrite: bool):
    """The transform one (n, n) pattern at a time (the ablation's unbatched baseline)."""
    flat = a.reshape((-1,) + a.shape[-2:])
    out = get_xp(a).empty(flat.shape, dtype=np.result_type(a.dtype, np.complex64))
    for i in range(flat.shape[0]):
        out[i] = _transform(flat[i], inverse, False)
    return out.reshape(a.shape)


def _apply_plan_cache_setting() -> None:
    global _PLAN_CACHE_SET
    if not _PLAN_CACHE_SET:
        _PLAN_CACHE_SET = True
        if not FFT_SETTINGS["plan_cache"]:
            import cupy  # lazy: optional GPU dependency

            cupy.fft.config.get_plan_cache().set_size(0)


def fft2(a, overwrite: bool = False):
    """Orthonormal 2-D FFT over the last two axes, batched over the leading axes.

    ``overwrite=True`` lets the transform reuse ``a``'s memory (pass temporaries only): scipy's
    ``overwrite_x`` on the CPU, an in-place cuFFT execution on the GPU; the result may or may not
    be ``a`` itself (see ``_fft_in_place`` of the LSQML engine).
    """
    if not FFT_SETTINGS["batched"] and a.ndim > 2:
        return _per_pattern(a, False, overwrite)
    return _transform(a, False, overwrite)


def ifft2(a, overwrite: bool = False):
    """Orthonormal inverse 2-D FFT over the last two axes (the adjoint of :func:`fft2`)."""
    if not FFT_SETTINGS["batched"] and a.ndim > 2:
        return _per_pattern(a, True, overwrite)
    return _transform(a, True, overwrite)


def shares_memory(out, buf) -> bool:
    """True when ``out`` is ``buf``'s memory with the same layout (a transform done in place)."""
    if out.shape != buf.shape or out.strides != buf.strides:
        return False
    ptr = getattr(out.data, "ptr", None)
    if ptr is not None:  # CuPy
        return ptr == getattr(buf.data, "ptr", None)
    return out.__array_interface__["data"][0] == buf.__array_interface__["data"][0]


def fftfreq(n: int, xp=np):
    return xp.fft.fftfreq(n).astype(np.float32)


def real_dots(x, y, chunk: int = 1024):
    """Per-item real inner products Re⟨x_j, y_j⟩ = Σ Re(conj(x_j) y_j) → (B,) float64.

    ``x``, ``y``: (B, ...) arrays of one dtype (complex or real) and shape, the last axis
    contiguous (``y`` may be a broadcast view). For complex arrays Re(conj(a) b) = a.re b.re +
    a.im b.im is the dot product of the real views, so batched BLAS dots do it in one pass. Single
    precision is accumulated in float32 over ``chunk`` elements and in float64 across chunks, which
    keeps the error near that of a float64 sum of the float32 products (~1e-7 relative to Σ|x y|).
    """
    x, y = _real_items(x), _real_items(y)
    return _chunked_sums(x, y[:, :, None], chunk, batched=True)[:, 0]


def _real_items(a):
    """(B, ...) complex or real → (B, N) real view (re, im interleaved for complex), no copy."""
    if a.dtype.kind == "c":
        a = a.view(np.float32 if a.dtype == np.complex64 else np.float64)
    return a.reshape(a.shape[0], -1)


def _chunked_sums(x, y, chunk: int, batched: bool):
    """Σ_p x_jp y_(j)pc → (B, C) float64, accumulated in x's precision over ``chunk`` elements and
    in float64 across them (see :func:`real_dots`). ``x`` (B, N); ``y`` (B, N, C) if ``batched``
    else (N, C), shared by every item."""
    b, size = x.shape
    k = size // chunk if x.dtype == np.float32 else 0
    if k <= 1:
        out = (x[:, None, :] @ y)[:, 0] if batched else x @ y
        return out.astype(np.float64)
    m = k * chunk
    c = y.shape[-1]
    if batched:
        out = (x[:, :m].reshape(b, k, 1, chunk) @ y[:, :m].reshape(b, k, chunk, c)).reshape(b, k, c)
        out = out.sum(axis=1, dtype=np.float64)
        if m < size:
            out += (x[:, None, m:] @ y[:, m:])[:, 0]
    else:   # one matrix product per chunk of the items' axis: (k, B, chunk) @ (k, chunk, C)
        out = (x[:, :m].reshape(b, k, chunk).transpose(1, 0, 2) @ y[:m].reshape(k, chunk, c)).sum(
            axis=0, dtype=np.float64)
        if m < size:
            out += x[:, m:] @ y[m:]
    return out


def channel_dots(w, packed, chunk: int = 1024):
    """Σ_p w_jp (Re, Im)(packed_jp) per item → (B, 2) float64: two real images packed as the real
    and imaginary parts of one complex array (one gather takes both), each dotted with the real
    weights ``w`` (B, ...) of the same shape; precision as :func:`real_dots`."""
    b = w.shape[0]
    x = w.reshape(b, -1)
    return _chunked_sums(x, packed.view(x.dtype).reshape(b, x.shape[1], 2), chunk, batched=True)


def real_dots_with(x, fixed, chunk: int = 1024):
    """Re⟨x_j, f_m⟩ for every item j of ``x`` (B, ...) and each of the arrays ``fixed`` (a
    sequence of M arrays shaped like one item) → (B, M) float64: one matrix product per chunk of
    elements, not M broadcast passes; precision as :func:`real_dots`."""
    xp = get_xp(x)
    x = _real_items(x)
    f = xp.stack([_real_items(a[None])[0] for a in fixed], axis=1)   # (N, M)
    return _chunked_sums(x, f, chunk, batched=False)
