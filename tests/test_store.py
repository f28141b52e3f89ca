"""Data-set store: round trips, sharding, streaming writes, atomicity, validation (real Zarr stores)."""
from __future__ import annotations

import os
import tracemalloc

import dask.array as da
import numpy as np
import pytest
import zarr

import daskpty
from daskpty import DataError, PtychoData
from daskpty.io.writing import shard_layout
from daskpty.io.validate import check_values

from conftest import corrupt, leftovers, make_arrays


# --------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("dtype", ["uint16", "uint32", "float32"])
def test_round_trip_every_field_and_attribute(tmp_path, dtype):
    inten, pos, mask, probe = make_arrays(dtype=dtype)
    truth = {"object": (np.arange(40 * 50).reshape(40, 50) * (1 + 1j)).astype(np.complex64),
             "probe": probe[:1] * 2, "positions": pos + 0.01}
    data = daskpty.from_arrays(inten, pos, mask=mask, probe=probe, wavelength_m=1.5e-10,
                               detector_distance_m=2.0, detector_pixel_size_m=75e-6,
                               units={"positions": "object pixels (y, x)"},
                               provenance="unit test", truth=truth,
                               metadata={"beamline": "X", "energy_keV": 8.0})
    out = data.to_zarr(tmp_path / "rt.zarr")
    back = daskpty.open_data(tmp_path / "rt.zarr")
    for d in (out, back):
        assert isinstance(d, PtychoData)
        assert d.path == str(tmp_path / "rt.zarr")
        assert d.n_patterns == 12 and d.pattern_shape == (16, 16)
        assert d.intensities.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(d.intensities.compute(), inten)
        np.testing.assert_array_equal(d.positions, pos)
        assert d.positions.dtype == np.float64
        np.testing.assert_array_equal(d.mask, mask)
        assert d.mask.dtype == bool
        np.testing.assert_array_equal(d.probe, probe)
        assert d.probe.dtype == np.complex64
        np.testing.assert_array_equal(d.truth.object, truth["object"])
        np.testing.assert_array_equal(d.truth.probe, truth["probe"])
        np.testing.assert_array_equal(d.truth.positions, truth["positions"])
    m = back.metadata
    assert m["daskpty"] == {"format": "daskpty-dataset", "version": 1, "every_chunk_written": True}
    assert m["wavelength_m"] == 1.5e-10 and m["detector_distance_m"] == 2.0
    assert m["detector_pixel_size_m"] == 75e-6
    assert m["object_pixel_size_m"] == pytest.approx(1.5e-10 * 2.0 / (16 * 75e-6))
    assert m["units"]["positions"] == "object pixels (y, x)"
    assert m["units"]["intensities"] == "photon counts"
    assert m["provenance"] == "unit test"
    assert m["beamline"] == "X" and m["energy_keV"] == 8.0
    assert {**m, "daskpty": data.metadata["daskpty"]} == data.metadata  # + the writer's record


def test_optional_fields_absent_and_lazy_truth(tmp_path):
    inten, pos, _, _ = make_arrays()
    d = daskpty.from_arrays(inten, pos).to_zarr(tmp_path / "plain.zarr")
    assert d.mask is None and d.probe is None and d.truth is None
    assert d.metadata["wavelength_m"] is None and d.metadata["object_pixel_size_m"] is None
    # an explicit object pixel size is kept, not derived
    d2 = daskpty.from_arrays(inten, pos, wavelength_m=1e-10, detector_distance_m=1.0,
                             detector_pixel_size_m=1e-4, object_pixel_size_m=3e-8)
    assert d2.metadata["object_pixel_size_m"] == 3e-8
    # truth is read only on access
    d3 = daskpty.from_arrays(inten, pos, truth={"object": np.ones((30, 30), np.complex64)})
    d3 = d3.to_zarr(tmp_path / "t.zarr")
    assert "object" not in d3.truth._cache
    assert d3.truth.shapes() == {"object": ((30, 30), "complex64")}
    assert d3.truth.object.shape == (30, 30) and d3.truth.probe is None


def test_from_arrays_normalises_friendly_inputs():
    inten, pos, mask, probe = make_arrays()
    d = daskpty.from_arrays(inten, pos.astype(np.float32), mask=mask.astype(np.uint8),
                            probe=probe[0].astype(np.complex128))
    assert d.positions.dtype == np.float64
    assert d.mask.dtype == bool
    assert d.probe.shape == (1, 16, 16) and d.probe.dtype == np.complex64
    dd = daskpty.from_arrays(da.from_array(inten, chunks=(5, 8, 8)), pos)
    assert dd.intensities.chunks[1:] == ((16,), (16,))


# --------------------------------------------------------------------------- sharding

def test_shard_layout_rule():
    # 128^2 uint16: 32 KiB per pattern -> 64 inner patterns (2 MiB), 2048 per 64 MiB shard
    assert shard_layout((262144, 128, 128), "uint16") == (2048, 64)
    assert shard_layout((262144, 128, 128), "uint16", shard_bytes=16 * 2**20) == (512, 64)
    # small data sets: at least 8 shards, unless shards would drop below 1 MiB
    assert shard_layout((1600, 128, 128), "uint16") == (192, 64)
    assert shard_layout((576, 64, 64), "uint16") == (128, 128)
    # everything fits in one shard: N is split evenly into inner chunks
    assert shard_layout((576, 64, 64), "uint16", min_shards=1) == (576, 192)
    assert shard_layout((577, 64, 64), "uint16", min_shards=1) == (579, 193)
    # big patterns: one pattern per inner chunk
    assert shard_layout((100, 1024, 1024), "float32") == (13, 1)
    with pytest.raises(ValueError):
        shard_layout((10, 4, 4), "uint16", shard_bytes=0)


def test_dask_chunks_are_shards_and_inner_chunks_are_smaller(tmp_path):
    rng = np.random.default_rng(1)
    inten = rng.poisson(5.0, size=(1000, 32, 32)).astype(np.uint16)  # 2 KiB per pattern
    pos = np.stack(np.divmod(np.arange(1000), 40), 1) * 2.0 + 20.0
    d = daskpty.from_arrays(inten, pos).to_zarr(tmp_path / "s.zarr", shard_bytes=256 * 1024,
                                                inner_bytes=32 * 1024)
    arr = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")["intensities"]
    assert arr.shards == (128, 32, 32)
    assert arr.chunks == (16, 32, 32)
    assert d.intensities.chunks[0] == (128,) * 7 + (104,)
    assert d.intensities.chunks[1:] == ((32,), (32,))
    assert d.chunk_length == 128
    # one file per shard
    files = [f for _, _, fs in os.walk(tmp_path / "s.zarr" / "intensities" / "c") for f in fs]
    assert len(files) == 8
    np.testing.assert_array_equal(d.intensities.compute(), inten)
    assert d.intensities.npartitions == 8  # one dask task reads one whole shard


# --------------------------------------------------------------------------- streaming

def _lazy_patterns(n_patterns, size, chunk):
    """A dask array built chunk by chunk from a seed (nothing big exists up front)."""
    def block(b, block_info=None):
        lo = block_info[None]["array-location"][0][0]
        rng = np.random.default_rng(lo)
        return rng.integers(0, 1000, size=b.shape, dtype=np.uint16)

    template = da.zeros((n_patterns, size, size), dtype=np.uint16, chunks=(chunk, size, size))
    return template.map_blocks(block, dtype=np.uint16)


def test_streaming_write_bigger_than_memory_budget(tmp_path):
    """~200 MB written with a traced peak far below the data size (local threads path)."""
    n, size = 6400, 128  # 6400 x 128 x 128 x 2 B = 210 MB
    x = _lazy_patterns(n, size, chunk=128)
    pos = np.stack(np.divmod(np.arange(n), 80), 1) * 4.0 + 70.0
    data = daskpty.from_arrays(x, pos)
    nbytes = x.nbytes
    tracemalloc.start()
    try:
        out = data.to_zarr(tmp_path / "big.zarr", shard_bytes=4 * 2**20, inner_bytes=2**20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert nbytes > 200e6
    assert peak < 0.25 * nbytes, f"peak traced memory {peak / 1e6:.0f} MB"
    print(f"peak traced {peak / 1e6:.1f} MB for {nbytes / 1e6:.0f} MB")
    assert out.chunk_length == 128
    np.testing.assert_array_equal(out.intensities[-300:].compute(), x[-300:].compute())


def test_streaming_write_through_distributed_client(tmp_path, client):
    x = _lazy_patterns(600, 32, chunk=50)
    pos = np.stack(np.divmod(np.arange(600), 30), 1) * 3.0 + 20.0
    out = daskpty.from_arrays(x, pos).to_zarr(tmp_path / "d.zarr", shard_bytes=100 * 2048,
                                              inner_bytes=25 * 2048, client=client)
    assert out.intensities.chunks[0] == (100,) * 6
    np.testing.assert_array_equal(out.intensities.compute(scheduler="sync"), x.compute())


# --------------------------------------------------------------------------- atomicity

def _failing(n=400, size=16, bad_block=3):
    def block(b, block_info=None):
        if block_info[None]["chunk-location"][0] == bad_block:
            raise RuntimeError("simulated disk failure")
        return np.ones(b.shape, dtype=np.uint16)

    x = da.zeros((n, size, size), dtype=np.uint16, chunks=(50, size, size))
    return x.map_blocks(block, dtype=np.uint16), np.zeros((n, 2)) + 20.0


@pytest.mark.parametrize("on_cluster", [False, True])
def test_failed_write_leaves_no_store(tmp_path, client, on_cluster):
    x, pos = _failing()
    data = daskpty.from_arrays(x, pos)
    target = tmp_path / "fail.zarr"
    with pytest.raises(RuntimeError, match="simulated disk failure"):
        data.to_zarr(target, shard_bytes=50 * 512, inner_bytes=25 * 512,
                     client=client if on_cluster else None)
    assert not target.exists()
    assert leftovers(tmp_path) == []


def test_failed_overwrite_keeps_old_store(tmp_path, store_path):
    before = daskpty.open_data(store_path).intensities.compute()
    x, pos = _failing()
    with pytest.raises(RuntimeError):
        daskpty.from_arrays(x, pos).to_zarr(store_path, overwrite=True, shard_bytes=50 * 512)
    np.testing.assert_array_equal(daskpty.open_data(store_path).intensities.compute(), before)
    assert leftovers(store_path.parent) == []


def test_existing_path_refused_unless_overwrite(tmp_path, store_path):
    inten, pos, _, _ = make_arrays(n=8, dtype="uint32")
    data = daskpty.from_arrays(inten, pos)
    with pytest.raises(FileExistsError, match="overwrite"):
        data.to_zarr(store_path)
    assert daskpty.open_data(store_path).dtype == np.float32
    data.to_zarr(store_path, overwrite=True)
    d = daskpty.open_data(store_path)
    assert d.dtype == np.uint32 and d.n_patterns == 8
    # overwriting a store with itself works (reads finish before the swap)
    d.to_zarr(store_path, overwrite=True)
    np.testing.assert_array_equal(daskpty.open_data(store_path).intensities.compute(), inten)
    # never delete something that is not a Zarr store
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a Zarr store"):
        data.to_zarr(other, overwrite=True)
    assert (other / "keep.txt").read_text() == "precious"
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kind,pattern", [
    ("missing_positions", "no 'positions' array"),
    ("missing_intensities", "no 'intensities' array"),
    ("n_mismatch", "12 patterns but 11 positions"),
    ("nan_positions", "NaN or infinite .* pattern 3"),
    ("newer_version", "version 99, newer .* upgrade daskpty"),
    ("other_format", "'daskpty-reconstruction' store"),
    ("no_format", "not a daskpty data set"),
    ("mask_shape", "mask has shape"),
    ("probe_shape", "probe has shape"),
    ("wrong_dtype", "dtype float64"),
])
def test_open_data_structural_errors(store_path, kind, pattern):
    corrupt(store_path, kind)
    with pytest.raises(DataError, match=pattern) as info:
        daskpty.open_data(store_path)
    assert "\n" not in str(info.value)


def test_open_data_not_a_store(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        daskpty.open_data(tmp_path / "nope.zarr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a Zarr store"):
        daskpty.open_data(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("hello")
    with pytest.raises(DataError, match="not a Zarr store"):
        daskpty.open_data(tmp_path / "file.txt")
    zarr.create_group(str(tmp_path / "foreign.zarr"))
    with pytest.raises(DataError, match="not a daskpty data set"):
        daskpty.open_data(tmp_path / "foreign.zarr")
    zarr.create_array(str(tmp_path / "arr.zarr"), shape=(3,), dtype="f4")
    with pytest.raises(DataError, match="single Zarr array"):
        daskpty.open_data(tmp_path / "arr.zarr")


@pytest.mark.parametrize("kind,field", [
    ("nan_intensity", "n_nan"), ("inf_intensity", "n_inf"), ("negative_intensity", "n_negative")])
def test_value_checks(store_path, client, kind, field):
    good = check_values(daskpty.open_data(store_path))
    assert good.ok and good.n_values == 12 * 16 * 16
    corrupt(store_path, kind)
    data = daskpty.open_data(store_path)  # structural checks pass; values are checked on request
    for report in (check_values(data), check_values(data, client=client)):
        assert getattr(report, field) == 1 and not report.ok
        assert report.first_bad_pattern in (2, 5, 7)
    with pytest.raises(DataError, match="intensities contain 1 .* mask"):
        daskpty.open_data(store_path, validate="full")
    daskpty.open_data(store_path, validate=None)


def test_value_report_statistics(store_path):
    data = daskpty.open_data(store_path)
    x = data.intensities.compute()
    r = data.check_values()
    assert r.minimum == pytest.approx(float(x.min()))
    assert r.maximum == pytest.approx(float(x.max()))
    assert r.total == pytest.approx(float(x.sum(dtype=np.float64)), rel=1e-9)


def test_from_arrays_errors():
    inten, pos, mask, probe = make_arrays()
    cases = [
        (dict(intensities=inten[:0], positions=pos[:0]), "empty"),
        (dict(intensities=inten.astype(np.int8), positions=pos), "dtype int8"),
        (dict(intensities=inten.astype(np.complex64), positions=pos), "dtype complex64"),
        (dict(intensities=inten[0], positions=pos), "expected \\(N, H, W\\)"),
        (dict(intensities=inten[:, :, :15], positions=pos), "square"),
        (dict(intensities=inten, positions=pos[:-1]), "12 patterns but 11 positions"),
        (dict(intensities=inten, positions=pos[:, :1]), "expected \\(N, 2\\)"),
        (dict(intensities=inten, positions=np.where(np.arange(12)[:, None] == 4, np.inf, pos)),
         "NaN or infinite"),
        (dict(intensities=inten, positions=pos, mask=mask[:8]), "mask has shape"),
        (dict(intensities=inten, positions=pos, mask=mask * 2.5), "mask has dtype"),
        (dict(intensities=inten, positions=pos, probe=probe[:, :8]), "probe has shape"),
        (dict(intensities=inten, positions=pos, wavelength_m=-1.0), "wavelength_m"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(DataError, match=pattern):
            daskpty.from_arrays(kwargs.pop("intensities"), kwargs.pop("positions"), **kwargs)
    with pytest.raises(ValueError, match="reserved"):
        daskpty.from_arrays(inten, pos, metadata={"units": {}})
    with pytest.raises(ValueError, match="validate"):
        daskpty.open_data("x", validate="everything")
