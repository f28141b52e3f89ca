"""The one check GPU tests start with: CuPy importable and a CUDA device visible, else skip."""
import pytest


def cupy_or_skip():
    """Return the ``cupy`` module, or skip the calling test when there is no CuPy or no GPU."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception:
        pytest.skip("no CUDA device")
    return cupy
