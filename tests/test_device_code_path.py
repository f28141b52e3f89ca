"""The engines' device (CuPy) code path, run on the CPU through a NumPy-backed stand-in for CuPy.

Real CuPy runs only on a GPU machine (tests/test_gpu.py, skipped here). This stand-in makes
``get_xp`` return a module whose functions are NumPy's, so the branches taken for device arrays
(whole-chunk batches instead of cache-sized sub-batches, copy-back after out-of-place FFTs,
``cupyx.scatter_add`` instead of slice adds or ``bincount``, ``.get()`` to leave the device) run
and must give the CPU path's numbers. It checks the logic of those branches, not CuPy itself.
"""
import sys
import types

import numpy as np
import pytest

from daskpty.engines import ad, lsqml

from synthetic import make_dataset


class DeviceArray(np.ndarray):
    """An ndarray that the backend takes for a CuPy array."""

    def get(self):
        return np.array(self.view(np.ndarray))

    def set(self, host, stream=None):  # host → "device" copy (CuPy's ndarray.set)
        self[...] = host


DeviceArray.__module__ = "cupy"


def _on_device(a):
    return np.ascontiguousarray(a).view(DeviceArray)


def _fake_cupy(calls):
    cp = types.ModuleType("cupy")
    for name in dir(np):
        if not name.startswith("__"):
            setattr(cp, name, getattr(np, name))
    for name in ("asarray", "array", "ascontiguousarray", "empty", "zeros", "ones", "full"):
        setattr(cp, name, (lambda f: lambda *a, **k: f(*a, **k).view(DeviceArray))(getattr(np, name)))
    cp.ndarray = DeviceArray
    def counted(name, f):
        def wrapped(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return f(*a, **k)
        return wrapped

    cp.fft = types.SimpleNamespace(
        fft2=counted("fft", lambda a, norm=None: np.fft.fft2(a, norm=norm).view(DeviceArray)),
        ifft2=counted("fft", lambda a, norm=None: np.fft.ifft2(a, norm=norm).view(DeviceArray)),
        fftfreq=np.fft.fftfreq,
        ifftshift=lambda a, axes=None: np.fft.ifftshift(a, axes=axes).view(DeviceArray))
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cp.cuda = types.SimpleNamespace(get_current_stream=lambda: stream,
                                    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = counted("pinned", lambda shape, dtype=np.float64: np.empty(shape, dtype))
    cupyx.scatter_add = counted("scatter_add", lambda target, idx, vals: np.add.at(target.view(np.ndarray),
                                                                                   np.asarray(idx), vals))
    return cp, cupyx


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs the stand-in; yields the count of device FFT and scatter-add calls."""
    calls = {}
    cp, cupyx = _fake_cupy(calls)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    yield calls
    assert calls.get("fft", 0) > 0 and calls.get("scatter_add", 0) > 0  # the device branches ran


def _relative(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


def _assert_partials_close(dev, cpu, tol):
    assert set(dev.boxes) == set(cpu.boxes) and set(dev.arrays) == set(cpu.arrays)
    for key in cpu.boxes:
        assert type(dev.boxes[key].data) is np.ndarray  # left the "device"
        assert dev.boxes[key].offset == cpu.boxes[key].offset
        assert _relative(dev.boxes[key].data, cpu.boxes[key].data) < tol, key
    for key in cpu.arrays:
        assert _relative(dev.arrays[key], cpu.arrays[key]) < tol, key
    for key, value in cpu.scalars.items():
        assert dev.scalars[key] == pytest.approx(value, rel=tol, abs=1e-12), key


@pytest.mark.parametrize("noise", ["gaussian", "poisson"])
@pytest.mark.parametrize("modes", [1, 2])
def test_lsqml_chunk_step_device_path_matches_cpu(fake_cupy, noise, modes):
    ds = make_dataset(n=32, grid=6, modes=modes, seed=7)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float32)
    valid = np.ones(y.shape[-2:], bool)
    valid[0, :3] = False
    obj = ds.truth.object * np.complex64(0.9)
    opts = lsqml.LSQMLOptions(noise=noise)
    cpu = lsqml.chunk_step(obj, ds.truth.probe, y, ds.positions, options=opts, valid=valid)
    dev = lsqml.chunk_step(obj, ds.truth.probe, _on_device(y), ds.positions, options=opts,
                           valid=valid)
    _assert_partials_close(dev, cpu, 2e-4)


@pytest.mark.parametrize("loss", ["gaussian", "poisson", "intensity"])
def test_ad_chunk_gradient_device_path_matches_cpu(fake_cupy, loss):
    ds = make_dataset(n=32, grid=6, seed=8)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float32)
    obj = ds.truth.object * np.complex64(0.9)
    opts = ad.ADOptions(loss=loss)
    cpu = ad.chunk_gradient(obj, ds.truth.probe, y, ds.positions, options=opts)
    dev = ad.chunk_gradient(obj, ds.truth.probe, _on_device(y), ds.positions, options=opts)
    _assert_partials_close(dev, cpu, 2e-4)


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
def test_reconstruct_on_device_chunks_matches_cpu(fake_cupy, engine):
    """The execution layer's device path end to end on two in-process workers: chunks staged
    through pinned memory onto the "device" (``meta`` of the device type, so nothing runs on the
    client to guess it), persisted there, chunk steps on device arrays inside the fused round
    tasks, partials back on the host. Must give the CPU path's object."""
    import daskpty
    from distributed import Client, LocalCluster

    ds = make_dataset(grid=8, seed=3)
    start = np.ones_like(ds.truth.object)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        kwargs = {"engine": engine, "epochs": 3, "object": start, "client": client, "chunk_length": 16}
        cpu = daskpty.reconstruct(ds, device="cpu", **kwargs)
        assert fake_cupy == {}  # the CPU run took no device branch
        dev = daskpty.reconstruct(ds, device="auto", **kwargs)  # every worker "sees a GPU"
    assert fake_cupy.get("pinned", 0) == 4  # one pinned staging buffer per chunk
    assert _relative(dev.object, cpu.object) < 1e-4
    assert _relative(dev.probe, cpu.probe) < 1e-4
    assert [h["loss"] for h in dev.history] == pytest.approx([h["loss"] for h in cpu.history], rel=1e-4)
