"""FFTW for the CPU transforms, when pyFFTW is installed (``pip install "daskpty[fftw]"``).

On the small patterns of ptychography (up to 200² complex64) FFTW's SIMD codelets run the batched
2-D transform 1.1–3.3× faster than scipy's pocketfft on one core (64²: 5.5 vs 14 µs per pattern,
AMD EPYC with AVX2). pyFFTW is optional because the FFTW library its wheels carry is GPL-licensed;
without it :mod:`daskpty.physics.backend` uses scipy.fft.

Choice of backend: ``DASKPTY_FFT_BACKEND`` in the environment of the process (dask workers inherit
the client's environment when a local cluster starts them) or :func:`set_fft_backend`:
``auto`` (default: FFTW when importable, for patterns of at most :data:`AUTO_MAX_PIXELS`),
``fftw`` (every size; an error without pyFFTW), ``scipy``.

FFTW_ESTIMATE's plans are fast up to 200² here (48²: 1.7×, 64²: 2.6×, 128²: 1.8×, 200²: 1.4×
pocketfft's speed) but slow for 256² and 384² (0.16× and 0.34×: a plan whose strides fight the
cache); measured plans (FFTW_MEASURE) would be fast there too, but they are chosen by timing, so
two processes could pick different ones and compute different bits.

Every call plans afresh with ``FFTW_ESTIMATE`` (about 20 µs; FFTW keeps its own planner cache), so
no plan holds on to a chunk's arrays, concurrent worker threads share nothing, and the same shapes,
strides and alignment always give the same plan — results are bit-for-bit reproducible across
processes, which the N-worker equivalence and the bit-identical resume rely on. No dask in here.
"""
from __future__ import annotations

import os

import numpy as np

BACKENDS = ("auto", "fftw", "scipy")
_COMPLEX = {np.dtype(np.complex64), np.dtype(np.complex128)}
_REAL_TO_COMPLEX = {np.dtype(np.float32): np.complex64, np.dtype(np.float64): np.complex128}

#: ``auto`` hands larger patterns (n_y · n_x pixels) to scipy.fft (see the module docstring).
AUTO_MAX_PIXELS = 200 * 200

_backend = None  # resolved lazily: "fftw" or "scipy"
_every_size = False  # "fftw" asked for by name: FFTW for every pattern size


def _check(name: str) -> str:
    name = str(name).strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"unknown FFT backend {name!r}: use one of {', '.join(BACKENDS)} "
                         "(DASKPTY_FFT_BACKEND or daskpty.physics.fftw.set_fft_backend)")
    return name


def _resolve(name: str) -> str:
    name = _check(name)
    if name == "scipy":
        return "scipy"
    try:
        import pyfftw  # noqa: F401  (lazy: optional, GPL-licensed FFTW inside)
    except (ImportError, OSError) as exc:   # OSError: a pyFFTW whose FFTW library will not load
        if name == "fftw":
            raise ImportError(f'the FFT backend "fftw" needs a working pyFFTW ({type(exc).__name__}: {exc}): '
                              'pip install "daskpty[fftw]" (or set DASKPTY_FFT_BACKEND=scipy)') from None
        return "scipy"
    return "fftw"


def set_fft_backend(name: str) -> str:
    """Choose this process's CPU FFT backend (``auto``, ``fftw``, ``scipy``); returns the one in
    use. Worker processes follow ``DASKPTY_FFT_BACKEND``: set it before the cluster starts."""
    global _backend, _every_size
    _backend = _resolve(name)
    _every_size = _check(name) == "fftw"
    return _backend


def fft_backend() -> str:
    """The CPU FFT backend in use in this process: ``"fftw"`` or ``"scipy"``."""
    if _backend is None:
        set_fft_backend(os.environ.get("DASKPTY_FFT_BACKEND", "auto"))
    return _backend


def transform(a: np.ndarray, inverse: bool, overwrite: bool, threads: int = 1):
    """Orthonormal 2-D FFT (``inverse``: its inverse) over the last two axes of a NumPy array,
    batched over the leading axes, by FFTW; None when this backend cannot take ``a`` (not FFTW,
    or a dtype other than float32/64, complex64/128, or ``auto`` and a pattern above
    :data:`AUTO_MAX_PIXELS`), for the caller to fall back."""
    if fft_backend() != "fftw" or a.ndim < 2:
        return None
    if not _every_size and a.shape[-1] * a.shape[-2] > AUTO_MAX_PIXELS:
        return None
    dtype = np.dtype(a.dtype)
    if dtype not in _COMPLEX:
        if dtype not in _REAL_TO_COMPLEX:
            return None
        a, overwrite = a.astype(_REAL_TO_COMPLEX[dtype]), True
    import pyfftw  # lazy: optional dependency

    if a.ctypes.data % 16:   # FFTW's SIMD codelets need 16 bytes: without them other bits
        a, overwrite = a.copy(), True   # (a received buffer may sit anywhere): align a copy
    in_place = overwrite and a.flags.c_contiguous and a.flags.writeable
    out = a if in_place else np.empty(a.shape, a.dtype)
    plan = pyfftw.FFTW(a, out, axes=(-2, -1), direction="FFTW_BACKWARD" if inverse else "FFTW_FORWARD",
                       flags=("FFTW_ESTIMATE",), threads=max(1, int(threads)))
    plan.execute()
    scale = 1.0 / np.sqrt(float(a.shape[-1] * a.shape[-2]))
    out *= out.real.dtype.type(scale)
    return out
