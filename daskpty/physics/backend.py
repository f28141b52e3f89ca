"""Array-namespace helpers: one code path for NumPy (CPU) and CuPy (GPU) arrays.

Nothing here imports dask. CuPy is optional and imported lazily.
"""
from __future__ import annotations

import os

import numpy as np
import scipy.fft

_FFT_WORKERS = int(os.environ.get("DASKPTY_FFT_WORKERS", "1"))


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
            import cupy

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


def fft2(a, overwrite: bool = False):
    """Orthonormal 2-D FFT over the last two axes, batched over the leading axes.

    ``overwrite=True`` lets the CPU transform reuse ``a``'s memory (pass temporaries only).
    """
    if is_cupy(a):
        import cupy

        return cupy.fft.fft2(a, norm="ortho")
    return scipy.fft.fft2(a, norm="ortho", workers=_FFT_WORKERS, overwrite_x=overwrite)


def ifft2(a, overwrite: bool = False):
    """Orthonormal inverse 2-D FFT over the last two axes (the adjoint of :func:`fft2`)."""
    if is_cupy(a):
        import cupy

        return cupy.fft.ifft2(a, norm="ortho")
    return scipy.fft.ifft2(a, norm="ortho", workers=_FFT_WORKERS, overwrite_x=overwrite)


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
    b = x.shape[0]
    if x.dtype.kind == "c":
        x = x.view(np.float32 if x.dtype == np.complex64 else np.float64)
        y = y.view(np.float32 if y.dtype == np.complex64 else np.float64)
    x = x.reshape(b, -1)
    y = y.reshape(b, -1)
    size = x.shape[1]
    k = size // chunk if x.dtype == np.float32 else 0
    if k <= 1:
        return (x[:, None, :] @ y[:, :, None]).reshape(b).astype(np.float64)
    m = k * chunk
    out = (x[:, :m].reshape(b, k, 1, chunk) @ y[:, :m].reshape(b, k, chunk, 1)).reshape(b, k)
    out = out.sum(axis=1, dtype=np.float64)
    if m < size:
        out += (x[:, None, m:] @ y[:, m:, None]).reshape(b)
    return out
