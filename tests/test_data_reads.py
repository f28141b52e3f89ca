"""How often a run reads its data: persisted data are read from their source once.

The value check (NaN, infinite, negative, no counts) of persisted data runs on the chunks where
they were placed, so the source (a Zarr store, a user's dask array) is read once, not once for
the check and again for the placement; bad values are still named by the pattern's number in the
data set, whatever order the run holds the patterns in.
"""
from __future__ import annotations

import sys
import threading

import dask.array as da
import numpy as np
import pytest

import daskpty
from synthetic import make_dataset


ROWS: dict[str, int] = {}  # patterns read per source (the workers run in this process)
_LOCK = threading.Lock()


class CountingSource:
    """An array-like that counts the patterns read from it (dask reads through ``__getitem__``;
    the graph travels pickled, so the counts live in this module, not in the copy)."""

    def __init__(self, array, name):
        self.array, self.name = array, name
        self.shape, self.dtype, self.ndim = array.shape, array.dtype, array.ndim
        ROWS[name] = 0

    @property
    def rows(self) -> int:
        return ROWS[self.name]

    def __getitem__(self, index):
        out = self.array[index]
        with _LOCK:
            ROWS[self.name] += out.shape[0] if out.ndim == 3 else 1
        return out


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


@pytest.fixture(scope="module")
def ds():
    return make_dataset(n=16, grid=10)  # small windows: shuffled positions make loose chunks


def _data(ds, source, positions=None):
    return daskpty.from_arrays(da.from_array(source, chunks=(8, -1, -1)),
                               ds.positions if positions is None else positions)


def test_persisted_data_with_a_given_probe_are_read_once(ds, client):
    source = CountingSource(ds.intensities, "given")
    daskpty.reconstruct(_data(ds, source), epochs=2, client=client, probe=ds.truth.probe, persist=True,
                        progress=False)
    assert source.rows == len(ds.intensities)


def test_data_the_start_probe_is_guessed_from_are_checked_first(ds, client):
    """With no probe, the start probe is made from the mean pattern: the value check runs first,
    on the source, and the mean comes from the same pass; bad values stop the run before it."""
    source = CountingSource(ds.intensities, "guessed")
    daskpty.reconstruct(_data(ds, source), epochs=2, client=client, persist=True, progress=False)
    assert source.rows == 2 * len(ds.intensities)  # the check with the mean, then the placement
    bad = ds.intensities.copy()
    bad[7, 3, 3] = np.nan
    with pytest.raises(ValueError, match=r"1 NaN value\(s\) \(first in pattern 7\)"):
        daskpty.reconstruct(_data(ds, CountingSource(bad, "guessed-bad")), epochs=1, client=client, persist=True,
                            progress=False)


@pytest.mark.parametrize("tiles", [False, True])
def test_bad_values_found_where_placed_are_named_by_their_number(ds, client, tiles):
    shuffled = np.random.default_rng(1).permutation(len(ds.positions))  # the run puts them in order
    bad = ds.intensities[shuffled]
    bad[[29, 4], 5, 6] = [-3.0, np.inf]
    source = CountingSource(bad, f"placed-{tiles}")
    with pytest.raises(ValueError, match=r"1 infinite, 1 negative value\(s\) \(first in pattern 4\)"):
        daskpty.reconstruct(_data(ds, source, ds.positions[shuffled]), epochs=1, client=client,
                            probe=ds.truth.probe, persist=True, tiles=tiles, chunk_length=8, progress=False)
    assert source.rows == len(bad)  # found in the placed chunks: no second pass over the source


class _OnDevice(np.ndarray):
    """A NumPy array that passes for a CuPy one (its type's module is ``cupy...``; ``.get()``)."""

    def get(self):
        return np.asarray(self).view(np.ndarray)


_OnDevice.__module__ = "cupy._core.core"


def _fake_cupy():
    import types

    module = types.ModuleType("cupy")
    def on_device(function):
        return lambda a: function(a).view(_OnDevice)

    module.isnan, module.isinf, module.isfinite = (on_device(f) for f in (np.isnan, np.isinf, np.isfinite))
    module.asarray = lambda a: np.asarray(a).view(_OnDevice)
    module.flatnonzero = lambda a: np.flatnonzero(a).view(_OnDevice)
    return module


@pytest.mark.parametrize("dtype", ["float32", "uint16"])
def test_chunks_on_gpu_workers_are_counted_as_on_the_host(monkeypatch, dtype):
    """The value check's per-chunk counts take CuPy chunks (placed data on GPU workers) and give
    the NumPy chunk's numbers, with the bad rows fetched from the device to name the pattern."""
    from daskpty.io.validate import _block_stats

    block = np.random.default_rng(0).poisson(20.0, (6, 8, 8)).astype(dtype)
    if dtype == "float32":
        block[[4, 2], 1, 1] = [np.nan, -1.0]
    numbers = np.array([50, 10, 41, 7, 3, 60])
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    on_device = _block_stats(block.view(_OnDevice), numbers)
    on_host = _block_stats(block, numbers)
    assert on_device == on_host
    assert on_host[6] == (3 if dtype == "float32" else -1)  # rows 2 and 4 are patterns 41 and 3
    assert all(type(v) in (int, float) for v in on_device)


def test_the_first_probe_rescale_takes_the_checks_total_instead_of_a_pass(ds, client):
    """One slice in the far field, no mask, a uniform start object: Σŷ = N |c|² Σ‖P‖² (unitary
    FFTs), so the first epoch's rescale takes Σy from the value check and makes no pass of its
    own; it scales the probe as the pass over the chunks does (sub-pixel positions included).
    A mask or an object that varies take the pass."""
    from daskpty.engines.specs import engine_spec
    from daskpty.execution.adapter import adapter_class
    from daskpty.execution.data import prepare_data

    positions = ds.positions + np.random.default_rng(2).uniform(-0.4, 0.4, ds.positions.shape)
    chunked = prepare_data(client, ds.intensities, positions, chunk_length=25, persist=True)
    adapter = adapter_class(engine_spec("lsqml"))()
    probe = (0.3 * ds.truth.probe).astype(np.complex64)
    flat = np.full_like(ds.truth.object, 0.7 + 0.2j)

    def start(obj):
        return adapter.new_state(obj, probe.copy())

    by_pass = adapter.initialise(client, chunked, start(flat), split_every=4)
    total = float(ds.intensities.sum(dtype=np.float64))
    closed = adapter.initialise_from_total(start(flat), total, len(ds.intensities))
    np.testing.assert_allclose(closed.probe, by_pass.probe, rtol=2e-5, atol=1e-6 * np.abs(by_pass.probe).max())
    assert not np.allclose(closed.probe, probe)                      # (it did rescale)
    varied = flat.copy()
    varied[3, 4] *= 0.5
    assert adapter.initialise_from_total(start(varied), total, len(ds.intensities)) is None
    assert adapter.initialise_from_total(start(flat), None, len(ds.intensities)) is None
    masked = adapter_class(engine_spec("lsqml"))(valid=np.ones(ds.intensities.shape[-2:], bool))
    assert masked.initialise_from_total(masked.new_state(flat, probe.copy()), total, len(ds.intensities)) is None


def test_a_run_rescaled_from_the_checks_total_ends_as_one_rescaled_by_a_pass(ds, client):
    """The whole run: with the value check (its Σy, no pass) and without it (the pass), the same
    reconstruction to float rounding."""
    runs = [daskpty.reconstruct(daskpty.from_arrays(ds.intensities, ds.positions), epochs=3, client=client,
                                check_data=check, progress=False) for check in (True, False)]
    scale = np.abs(runs[1].object).max()
    np.testing.assert_allclose(runs[0].probe, runs[1].probe, rtol=1e-4, atol=1e-5 * np.abs(runs[1].probe).max())
    np.testing.assert_allclose(runs[0].object, runs[1].object, rtol=1e-4, atol=1e-5 * scale)
