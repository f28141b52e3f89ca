"""The pass counter (daskpty.physics.counting) and benchmarks/bench_passes.py: exact counts of known
sequences, chunk steps that give the same bits counted and uncounted, and FFT / pass counts that
scale with the chunk length and the slices as the forward model says."""
import os
import sys

import numpy as np
import pytest

from daskpty.engines import lsqml
from daskpty.physics import backend, fft2, kernels
from daskpty.physics.counting import PassCounter

from synthetic import make_dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_passes  # noqa: E402

N = 32
PLANE = 8 * N * N   # bytes of one complex64 pattern


def _planes(b, dtype=np.complex64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, N, N)) + 1j * rng.standard_normal((b, N, N))).astype(dtype)


def test_a_times_b_plus_c_is_two_passes_and_an_fft_one_batched_transform_per_pattern():
    a, b, c = (_planes(16, seed=s) for s in range(3))
    with PassCounter(N * N) as counter:
        x, y, z = (counter.wrap(v) for v in (a, b, c))
        out = fft2(x * y + z)
    t = counter.tally
    assert t.passes == 2 * 16 and t.calls == 2
    assert t.bytes_read == 4 * 16 * PLANE and t.bytes_written == 2 * 16 * PLANE
    assert t.transforms() == 16 and t.transforms(N, N) == 16 and t.fft_calls == 1
    assert t.fft_bytes == 2 * 16 * PLANE
    np.testing.assert_array_equal(np.asarray(out), fft2(a * b + c))


def test_broadcasts_in_place_ops_views_gathers_and_small_ops():
    a = _planes(8)
    p = _planes(1, seed=4)[0]
    with PassCounter(N * N) as counter:
        x = counter.wrap(a)
        x *= p[None]                    # one pass: reads x and p once, writes x
        v = x[2:5].reshape(3, -1)       # views: free
        g = x[[0, 3, 3]]                # a gather of 3 planes
        s = np.abs(x).sum(axis=(1, 2))  # two passes (abs, then the reduction reading the real planes)
        s * 2                           # 8 numbers: below one plane
    t = counter.tally
    assert t.ops["multiply"].calls == 1 and t.ops["multiply"].passes == 8
    assert t.ops["multiply"].read == 8 * PLANE + PLANE and t.ops["multiply"].written == 8 * PLANE
    assert t.ops["gather"].passes == 3 and t.ops["gather"].written == 3 * PLANE
    assert t.ops["absolute"].passes == 8 and t.ops["add.reduce"].passes == 8
    assert set(t.ops) == {"multiply", "gather", "absolute", "add.reduce"} and t.small_calls == 1
    assert v.shape == (3, N * N) and g.shape == (3, N, N) and s.shape == (8,)


def test_numpy_and_the_fft_hook_are_restored_also_after_an_error():
    saved = (np.empty, np.asarray, backend._transform)
    with pytest.raises(ValueError, match="outside the object"):
        with PassCounter(N * N):
            assert np.empty is not saved[0] and backend._transform is not saved[2]
            lsqml.chunk_step(np.ones((8, 8), np.complex64), np.ones((1, N, N), np.complex64),
                             np.ones((1, N, N), np.float32), np.array([[100.0, 100.0]]), options=lsqml.LSQMLOptions())
    assert (np.empty, np.asarray, backend._transform) == saved
    assert type(np.zeros(3)) is np.ndarray
    with pytest.raises(ValueError, match="plane"):
        PassCounter(0)


def _bits(part):
    out = {("scalar", k): v for k, v in part.scalars.items()}
    out.update({("box", k): (b.offset, np.asarray(b.data)) for k, b in part.boxes.items()})
    out.update({("array", k): np.asarray(v) for k, v in part.arrays.items()})
    out.update({("local", k): np.asarray(v) for k, v in part.local.items() if not isinstance(v, tuple)})
    return out


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert x[0] == y[0]
            x, y = x[1], y[1]
        np.testing.assert_array_equal(x, y, err_msg=str(key))
        assert np.asarray(x).dtype == np.asarray(y).dtype


def test_a_counted_lsqml_chunk_step_gives_the_same_bits_and_fused_kernels_count_one_pass_per_call():
    ds = make_dataset(n=N, grid=6, seed=3)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1))
    obj, probe = (0.9 * ds.truth.object).astype(np.complex64), ds.truth.probe.astype(np.complex64)
    options = lsqml.LSQMLOptions()
    plain = lsqml.chunk_step(obj, probe, y, ds.positions, options=options, position_terms=True)
    tallies = {}
    for fused in (False, True):
        with PassCounter(N * N, fused=fused) as counter:
            counted = lsqml.chunk_step(*(counter.wrap(v) for v in (obj, probe, y, ds.positions)), options=options,
                                       position_terms=True)
        _same_bits(_bits(plain), _bits(counted))
        tallies[fused] = counter.tally
    assert kernels.far_field_update.__module__ == "daskpty.physics.kernels"   # unbound again
    assert tallies[False].transforms(N, N) == tallies[True].transforms(N, N) == 5 * 36 + 2
    update = tallies[True].ops["kernels.far_field_update"]     # reads Ψ and y, writes Ψ', ŷ and the loss
    assert update.passes == 36 and update.read == 36 * (PLANE + 4 * N * N) and update.written == update.read + 36 * 8
    assert not any(name.startswith("kernels.") for name in tallies[False].ops)
    assert 20 * 36 < tallies[True].passes < tallies[False].passes - 5 * 36


@pytest.mark.parametrize("engine, part", [("ad", "1 slice"), ("rpie", "positions"), ("lsqml", "OPR"),
                                          ("ad", "K slices"), ("lsqml", "near field")])
def test_counted_steps_of_the_benchmark_give_the_same_bits(engine, part):
    args, step = bench_passes.step_function(engine, part, N, 16, 2, 2)
    plain = step(*args)
    counted, tally = bench_passes.count_step(engine, part, N, 16, 2, 2)
    _same_bits(_bits(plain), _bits(counted))
    assert tally.passes > 0 and tally.transforms() > 0


@pytest.mark.parametrize("engine, per_pattern", [("lsqml", 5), ("ad", 4), ("rpie", 4)])
def test_one_slice_counts_scale_with_the_chunk_length(engine, per_pattern):
    """LSQML: per pattern the probe shift, the far field, its inverse, the probe gradient's shift
    back and the step length's probe shift; AD and rPIE: the first four. Per step the probe's
    spectrum and the probe sum's inverse. Per-pattern passes and bytes do not depend on B."""
    rows = {}
    for b in (16, 64):
        _, tally = bench_passes.count_step(engine, "1 slice", N, b)
        assert tally.transforms(N, N) == per_pattern * b + 2
        rows[b] = bench_passes.row(engine, "1 slice", tally, N, b, 4800.0, 262144)
    for key in ("passes", "read_x", "written_x"):
        assert rows[64][key] == pytest.approx(rows[16][key], rel=0.03), key
    assert 10 < rows[64]["passes"] < 100


@pytest.mark.parametrize("engine", ["ad", "rpie"])
def test_k_slices_count_four_transforms_per_slice_and_passes_linear_in_k(engine):
    """Forward: the probe shift, K − 1 propagations (a transform and its inverse each) and the
    detector's transform; the adjoint the same backwards: 4K transforms per pattern."""
    passes = {}
    for k in (2, 3, 4):
        _, tally = bench_passes.count_step(engine, "K slices", N, 16, slices=k)
        assert tally.transforms(N, N) == 4 * k * 16 + 2
        passes[k] = tally.passes / 16
    assert passes[4] - passes[3] == pytest.approx(passes[3] - passes[2], rel=0.02)
    assert passes[4] - passes[3] > 5


def test_whole_chunk_steps_keep_the_passes_and_make_fewer_calls():
    _, blocked = bench_passes.count_step("lsqml", "1 slice", 64, 48)   # 64²: sub-batches of 16 on the CPU
    with bench_passes.whole_chunks():
        _, whole = bench_passes.count_step("lsqml", "1 slice", 64, 48)
    assert lsqml.CPU_BLOCK_BYTES == 1 << 20                 # restored
    assert whole.passes == pytest.approx(blocked.passes, rel=0.01)
    assert whole.transforms() == blocked.transforms() and whole.fft_calls < blocked.fft_calls
    assert whole.calls < blocked.calls


def test_the_benchmark_prints_its_table(capsys):
    assert bench_passes.main(["--probe-size", "32", "--chunk-length", "16", "--engines", "lsqml,rpie",
                              "--parts", "1 slice,OPR", "--no-time", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "| lsqml | 1 slice |" in out and "| rpie | 1 slice |" in out and "| lsqml | OPR |" in out
    assert "| rpie | OPR |" not in out and "multiply" in out   # rPIE has no OPR
    with pytest.raises(SystemExit):
        bench_passes.main(["--parts", "2 slices"])


def test_the_poisson_step_length_stops_once_every_pattern_has_converged():
    """Newton's steps for the Poisson α end when every pattern's step is at most ALPHA_STEP_DONE:
    allowing 40 steps costs the passes of allowing 10, and α is the 10-step one to 1e-9."""
    from daskpty.physics.noise import poisson_step_lengths

    rng = np.random.default_rng(5)
    yhat = rng.gamma(2.0, 4.0, (12, N, N))
    y = rng.poisson(yhat * rng.uniform(0.5, 1.5, (12, 1, 1))).astype(np.float64)
    tallies, alphas = [], []
    for iterations in (10, 40):
        with PassCounter(N * N) as counter:
            alphas.append(np.asarray(poisson_step_lengths(counter.wrap(yhat), counter.wrap(y), iterations=iterations)))
        tallies.append(counter.tally.passes)
    assert tallies[0] == tallies[1] > 0
    np.testing.assert_allclose(alphas[0], alphas[1], atol=1e-9)
    assert ((alphas[0] > 0.05) & (alphas[0] < 1)).all()
