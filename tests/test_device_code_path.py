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
    """An ndarray that the backend takes for a CuPy array.

    Like CuPy it refuses to mix with host arrays: an operation given a plain NumPy array of one
    element or more beside a device array raises TypeError (CuPy: "Unsupported type"), so code
    that builds a host array where it needed ``xp`` fails here as it would on a GPU."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        outs = kwargs.get("out", ())
        for a in (*inputs, *outs):
            if type(a) is np.ndarray and a.ndim > 0:
                raise TypeError(f"Unsupported type {type(a)} beside a device array in {ufunc.__name__}")
        inputs = tuple(a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in inputs)
        if outs:
            kwargs["out"] = tuple(a.view(np.ndarray) if isinstance(a, DeviceArray) else a for a in outs)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if outs:
            return outs[0] if len(outs) == 1 else outs
        if isinstance(result, tuple):
            return tuple(_wrap(r) for r in result)
        return _wrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        """``np.func(device array)`` runs on the device, as CuPy's NEP-18 dispatch does."""
        _refuse_host(args)
        _refuse_host(kwargs.values())
        out = kwargs.get("out")
        result = func(*_as_host_views(args), **dict(zip(kwargs, _as_host_views(kwargs.values()))))
        if out is not None:
            return out
        return tuple(_wrap(r) for r in result) if isinstance(result, tuple) else _wrap(result)

    def get(self):
        return np.array(self.view(np.ndarray))

    def set(self, host, stream=None):  # host → "device" copy (CuPy's ndarray.set)
        self[...] = host


DeviceArray.__module__ = "cupy"


def _wrap(result):
    return result.view(DeviceArray) if isinstance(result, np.ndarray) else result


def _as_host_views(args):
    return tuple(a.view(np.ndarray) if isinstance(a, DeviceArray) else
                 _as_host_views(a) if isinstance(a, (list, tuple)) else a for a in args)


def _on_device(a):
    return np.ascontiguousarray(a).view(DeviceArray)


def _refuse_host(args):
    for a in args:
        if type(a) is np.ndarray and a.ndim > 0:
            raise TypeError(f"Unsupported type {type(a)}: a host array given to a device function")
        if isinstance(a, (list, tuple)):
            _refuse_host(a)


def _device_function(f, takes_host: bool = False):
    """``f`` as a CuPy function: device arrays out; host arrays in only where CuPy takes them."""
    def wrapped(*args, **kwargs):
        if not takes_host:
            _refuse_host(args)
            _refuse_host(kwargs.values())
        out = f(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(_wrap(o) for o in out)
        return _wrap(out)
    return wrapped


#: Complex 2-D host arrays at least this large that go to the device count as object uploads
#: (the test objects are ~70²; a chunk's box of them at least 32²; probes are 3-D).
OBJECT_UPLOAD_SIZE = 32 * 32

#: The CuPy functions that take host data (``cupy.asarray`` and friends copy it to the device).
_HOST_TO_DEVICE = ("asarray", "array", "ascontiguousarray")


def _fake_cupy(calls):
    cp = types.ModuleType("cupy")
    for name in dir(np):
        if name.startswith("__"):
            continue
        value = getattr(np, name)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)) or callable(value) and \
                type(value).__name__ in ("_ArrayFunctionDispatcher", "function"):
            value = _device_function(value, takes_host=name in _HOST_TO_DEVICE)
        setattr(cp, name, value)
    cp.linalg = types.SimpleNamespace(**{name: _device_function(getattr(np.linalg, name))
                                         for name in ("svd", "eigh", "solve", "norm", "qr", "inv")})
    upload = cp.asarray

    def asarray(a, *args, **kwargs):  # counts host → device copies of object-sized arrays
        if type(a) is np.ndarray and a.dtype.kind == "c" and a.size >= OBJECT_UPLOAD_SIZE:
            key = "object_uploads" if a.ndim == 2 else "stack_uploads"  # (K, H, W) slices, probes
            calls[key] = calls.get(key, 0) + 1
        return upload(a, *args, **kwargs)
    cp.asarray = asarray
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
                                    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                                                  memGetInfo=lambda: (15 * 2**30, 16 * 2**30)))
    cupyx = types.ModuleType("cupyx")
    cupyx.scipy = types.SimpleNamespace(fft=types.SimpleNamespace(  # in-place capable transforms
        fft2=counted("fft", lambda a, norm=None, overwrite_x=False: np.fft.fft2(a, norm=norm).view(DeviceArray)),
        ifft2=counted("fft", lambda a, norm=None, overwrite_x=False: np.fft.ifft2(a, norm=norm).view(DeviceArray))))
    cupyx.empty_pinned = counted("pinned", lambda shape, dtype=np.float64: np.empty(shape, dtype))
    cupyx.scatter_add = counted("scatter_add", lambda target, idx, vals: np.add.at(
        target.view(np.ndarray), np.asarray(idx).view(np.ndarray), np.asarray(vals).view(np.ndarray)))
    return cp, cupyx


def install_fake_cupy(monkeypatch) -> dict:
    """Put the stand-in in ``sys.modules`` (cupy, cupyx, cupyx.scipy.fft) for one test; returns
    the dict in which it counts device FFTs, scatter-adds, pinned buffers and uploads."""
    calls = {}
    cp, cupyx = _fake_cupy(calls)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setitem(sys.modules, "cupyx.scipy", cupyx.scipy)
    monkeypatch.setitem(sys.modules, "cupyx.scipy.fft", cupyx.scipy.fft)
    return calls


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs the stand-in; yields the count of device FFT and scatter-add calls."""
    calls = install_fake_cupy(monkeypatch)
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


def test_stand_in_refuses_host_arrays_like_cupy(fake_cupy):
    """The stand-in is only worth its tests if it fails where CuPy fails: a host array beside a
    device array, or given to a device function, raises."""
    import cupy

    dev = cupy.ones(4, np.float32)
    with pytest.raises(TypeError):
        dev + np.ones(4, np.float32)
    with pytest.raises(TypeError):
        cupy.maximum(dev, np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        np.vdot(dev, np.ones(4, np.float32))
    assert type(cupy.stack([dev, dev])) is type(dev) and type(np.sqrt(dev)) is type(dev)
    fake_cupy.update(fft=1, scatter_add=1)  # (this test calls neither)


def _cpu_and_both_state_layouts(data, calls: dict, counter: str, **kwargs):
    """Reconstruct ``data`` on two in-process workers on the CPU, then on the stand-in device
    with device-resident state and with the state on the host. Returns the CPU result, the two
    device results and the uploads ``calls[counter]`` counted during each ({resident: ...})."""
    import daskpty
    from daskpty.execution import device_state
    from distributed import Client, LocalCluster

    results, uploads = {}, {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        cpu = daskpty.reconstruct(data, device="cpu", client=client, **kwargs)
        for resident in (True, False):
            device_state.set_device_state(resident)
            try:
                before = calls.get(counter, 0)
                results[resident] = daskpty.reconstruct(data, device="auto", client=client, **kwargs)
                uploads[resident] = calls.get(counter, 0) - before
            finally:
                device_state.set_device_state(True)
    return cpu, results, uploads


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
@pytest.mark.slow
def test_state_stays_on_device_between_rounds(fake_cupy, engine):
    """Device-resident state: each worker uploads its copy of the object once; the chunk steps,
    the worker's own sums and ``apply`` then run on the device, round after round and epoch
    after epoch, and the client receives NumPy arrays. With the state kept on the host
    (DASKPTY_DEVICE_STATE=0) every chunk step uploads its object box instead. Both give the CPU
    path's result."""
    ds = make_dataset(grid=8, seed=5)
    start = np.ones_like(ds.truth.object)
    epochs, rounds, chunks = 3, 2, 4
    kwargs = {"engine": engine, "epochs": epochs, "object": start, "chunk_length": 16,
              "rounds_per_epoch": rounds}
    cpu, results, uploads = _cpu_and_both_state_layouts(ds, fake_cupy, "object_uploads", **kwargs)
    for rec in results.values():
        assert type(rec.object) is np.ndarray and type(rec.probe) is np.ndarray  # left the device
        assert _relative(rec.object, cpu.object) < 1e-4
        assert _relative(rec.probe, cpu.probe) < 1e-4
    # One upload per worker copy of the state (the first probe rescale takes the value check's
    # total here: no round of its own); on the host, every chunk step uploads its box.
    assert uploads[True] == 2
    assert uploads[False] >= chunks * rounds * epochs


@pytest.mark.parametrize("engine", ["lsqml", "ad"])
@pytest.mark.slow
def test_multislice_state_stays_on_device(fake_cupy, engine):
    """The multislice engines' (K, H, W) state is device-resident too: same result as the CPU and
    as the host-state layout, with far fewer uploads of the slices."""
    import daskpty
    from daskpty.simulate.multislice import simulate_multislice

    ds = simulate_multislice(n_slices=2, noise=False, seed=2)
    g = ds.geometry
    data = daskpty.from_arrays(ds.intensities.astype(np.float32), ds.positions, wavelength_m=g.wavelength_m,
                               object_pixel_size_m=g.pixel_size_m)
    kw = dict(engine=engine, epochs=3, rounds_per_epoch=2, chunk_length=25, slices=2, check_data=False,
              slice_spacing_m=2e-9)
    cpu, results, uploads = _cpu_and_both_state_layouts(data, fake_cupy, "stack_uploads", **kw)
    for rec in results.values():
        assert type(rec.object) is np.ndarray and rec.object.shape == cpu.object.shape
        assert _relative(rec.object, cpu.object) < 1e-4
    assert 3 * uploads[True] < uploads[False]
