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
