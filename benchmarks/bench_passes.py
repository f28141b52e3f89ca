"""Passes per pattern: what one chunk step of each engine and part costs in memory traffic and FFTs.

Usage (not run in CI):

    python benchmarks/bench_passes.py [--probe-size 128] [--chunk-length 64] [--modes 4] [--slices 3]
        [--bandwidth-gbs 4800] [--epoch-patterns 262144] [--engines lsqml,ad,rpie] [--parts ...] [--ops]
        [--whole-chunk] [--noise poisson] [--no-time] [--json]

Runs one chunk step (LSQML ``chunk_step``, AD ``chunk_gradient``, rPIE ``chunk_step``; after an uncounted warm-up) on one
chunk of simulated patterns, no dask, inside :class:`daskpty.physics.counting.PassCounter`, for
each part of the forward model: ``1 slice`` (far field, one probe mode), ``K slices``, ``near
field`` (one slice, Fresnel detector), ``positions`` (position refinement's sums and the windows'
deformation sums), ``OPR`` (3 eigen-probes with per-pattern weights; LSQML and AD) and ``modes``
(incoherent probe modes). Per pattern it prints:

* passes: element-wise operations over pattern-sized arrays, in pattern planes (an operation
  over a (B, M, n, n) array is M passes per pattern; a window scatter-add of one n × n window
  is one plane);
* read / written: their bytes, in MB and in complex64 patterns (8 n² bytes);
* FFTs: 2-D transforms of n × n (batched calls counted one transform per pattern and mode);
* calls: element-wise calls of at least one plane per chunk step (kernel launches on the GPU). The
  CPU steps run sub-batches that fit the caches and add each window into the box apart (two
  calls per pattern), so they make more calls; ``--whole-chunk`` steps over the whole chunk at
  once, as the GPU path does (its box scatter is one call per array there);
* fused: the same with each call of a fused kernel of ``daskpty.physics.kernels`` (the far-field
  update, the object gradient, the conjugate products, the step-length dots: one CuPy kernel
  chain each on the GPU) counted as one pass that reads its arguments and writes its results once;
* floor: seconds per epoch of ``--epoch-patterns`` patterns at ``--bandwidth-gbs`` for the
  element-wise bytes, for the FFTs' bytes (one read and one write per transform), and both.

``--ops`` adds each part's operations by name (ufunc / function), biggest first: the fusion
targets. H200: ``--bandwidth-gbs 4800``; H100 SXM: ``3350``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from daskpty.engines import ad, lsqml, lsqml_opr, pie  # noqa: E402
from daskpty.engines import probe_model as pm  # noqa: E402
from daskpty.engines import forward_model  # noqa: E402
from daskpty.engines.ad import opr as ad_opr  # noqa: E402
from daskpty.engines.eigen_probes import initial_eigen_probes  # noqa: E402
from daskpty.physics import model_intensities  # noqa: E402
from daskpty.physics.counting import COMPLEX64_BYTES, PassCounter  # noqa: E402
from daskpty.physics.propagation import angular_spectrum_kernel, near_field_kernel  # noqa: E402

ENGINES = ("lsqml", "ad", "rpie")
PARTS = ("1 slice", "K slices", "near field", "positions", "OPR", "modes")
LAM, DX = 1.9687e-12, 0.25e-10   # 300 kV electrons, 0.25 Å pixels (the slices' propagator)


def scan(n: int, chunk: int, modes: int, seed: int = 0):
    """One chunk of a jittered raster scan: object (H, W), probe (modes, n, n), positions (B, 2),
    intensities (B, n, n) (DC at index 0) of a slightly different object, so every update is nonzero."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(np.sqrt(chunk)))
    step = max(1, n // 8)
    size = (side - 1) * step + n + 8
    phase = rng.standard_normal((size, size)).astype(np.float32)
    obj = np.exp(0.3j * phase).astype(np.complex64)
    yy, xx = np.mgrid[:n, :n] - n / 2
    disc = (np.hypot(yy, xx) < n / 4).astype(np.float32)
    probe = np.stack([disc * np.exp(1j * (0.01 * (yy**2 + xx**2) + m * np.arctan2(yy, xx)))
                      for m in range(modes)]).astype(np.complex64) * np.float32(30.0)
    grid = np.arange(side) * step + n / 2 + 4
    pos = np.stack(np.meshgrid(grid, grid, indexing="ij"), -1).reshape(-1, 2)[:chunk]
    pos = pos + rng.uniform(-0.4, 0.4, pos.shape)
    truth = obj * np.exp(0.05j * rng.standard_normal(obj.shape)).astype(np.complex64)
    y = model_intensities(truth, probe, pos).astype(np.float32)
    return obj, probe, pos, y


def _slices(obj, k: int):
    return np.stack([obj] + [np.exp(0.5 * np.log(obj)).astype(np.complex64)] * (k - 1))


def step_function(engine: str, part: str, n: int, chunk: int, modes: int, slices: int, noise: str = "gaussian"):
    """(arguments, step) for one chunk step of ``engine`` with ``part`` and the ``noise`` model
    (AD: its loss; LSQML: past any warm-up); None where the engine has no such part.
    ``step(*arguments)`` runs it; the arguments are what a counter must wrap."""
    obj, probe, pos, y = scan(n, chunk, modes if part == "modes" else 1)
    kernel = angular_spectrum_kernel(n, DX, LAM, 2e-9) if part == "K slices" else None
    detector = near_field_kernel(n, 55e-6, 1e-10, 1.0, 3e-3) if part == "near field" else None
    if part in ("K slices", "near field"):
        obj = _slices(obj, slices if part == "K slices" else 1)
    sample = forward_model.ForwardModel(obj.shape[0], kernel, detector) if obj.ndim == 3 else forward_model.THIN
    positions = part == "positions"
    if part == "OPR":
        model = pm.ProbeModelOptions(opr_modes=3, start_epoch=0).for_engine("lsqml" if engine == "lsqml" else "ad")
        eigen = initial_eigen_probes(probe[0], 2)
        local = pm.initial_local(chunk, model)
        extra = dict(model=model, eigen=eigen, transform=None, background=None, epoch=1)
        if engine == "lsqml":
            return (obj, probe, y, pos), lambda o, p, yy, q: lsqml_opr.variable_chunk_step(
                o, p, yy, q, dict(local), options=lsqml.LSQMLOptions(noise=noise), update_probe=True, **extra)
        if engine == "ad":
            return (obj, probe, y, pos), lambda o, p, yy, q: ad_opr.variable_chunk_gradient(
                o, p, yy, q, dict(local), options=ad.ADOptions(loss=noise), **extra)
        return None
    if engine == "lsqml":
        options = lsqml.LSQMLOptions(noise=noise, noise_warmup=0).for_slices(sample.n_slices)
        return (obj, probe, y, pos), lambda o, p, yy, q: lsqml.chunk_step(
            o, p, yy, q, options=options, sample=sample, position_terms=positions, window_sums=positions)
    if engine == "ad":
        return (obj, probe, y, pos), lambda o, p, yy, q: ad.chunk_gradient(
            o, p, yy, q, options=ad.ADOptions(loss=noise), sample=sample, want_positions=positions,
            window_sums=positions)
    return (obj, probe, y, pos), lambda o, p, yy, q: pie.chunk_step(
        o, p, yy, q, options=pie.PIEOptions(noise=noise), sample=sample, position_terms=positions,
        window_sums=positions)


@contextlib.contextmanager
def whole_chunks(enabled: bool = True):
    """Run the CPU chunk steps on the whole chunk at once, as the GPU path does, instead of
    sub-batches that fit the caches (passes and bytes stay; the calls per step become the GPU's)."""
    blocks = [(lsqml, "CPU_BLOCK_BYTES"), (forward_model, "CPU_BLOCK_BYTES"), (pie, "BLOCK_BYTES")]
    saved = [getattr(m, name) for m, name in blocks]
    try:
        if enabled:
            for m, name in blocks:
                setattr(m, name, 1 << 62)
        yield
    finally:
        for (m, name), value in zip(blocks, saved):
            setattr(m, name, value)


def count_step(engine: str, part: str, n: int = 128, chunk: int = 64, modes: int = 4, slices: int = 3,
               fused: bool = False, noise: str = "gaussian"):
    """(partial, tally) of one counted chunk step, or None where the engine has no such part;
    ``fused``: each call of a fused kernel (``daskpty.physics.kernels``) counted as one pass.
    One uncounted step runs first, so that what the engines cache between steps is not counted."""
    made = step_function(engine, part, n, chunk, modes, slices, noise)
    if made is None:
        return None
    args, step = made
    step(*args)
    with PassCounter(n * n, fused=fused) as counter:
        part_out = step(*(counter.wrap(a) for a in args))
    return part_out, counter.tally


def time_step(engine: str, part: str, n: int, chunk: int, modes: int, slices: int, repeat: int = 3,
              noise: str = "gaussian") -> float:
    """Median seconds of the uncounted chunk step on this CPU."""
    args, step = step_function(engine, part, n, chunk, modes, slices, noise)
    step(*args)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def row(engine: str, part: str, tally, n: int, chunk: int, bandwidth_gbs: float, epoch_patterns: int) -> dict:
    """Per-pattern figures of one counted step and the bandwidth floor they imply."""
    pattern = COMPLEX64_BYTES * n * n
    ew = (tally.bytes_read + tally.bytes_written) / chunk
    fft = tally.fft_bytes / chunk
    scale = epoch_patterns / (bandwidth_gbs * 1e9)
    return {"engine": engine, "part": part, "passes": tally.passes / chunk,
            "read_mb": tally.bytes_read / chunk / 1e6, "written_mb": tally.bytes_written / chunk / 1e6,
            "read_x": tally.bytes_read / chunk / pattern, "written_x": tally.bytes_written / chunk / pattern,
            "ffts": tally.transforms(n, n) / chunk, "fft_calls": tally.fft_calls, "calls": tally.calls,
            "small_calls": tally.small_calls, "floor_ew_s": ew * scale, "floor_fft_s": fft * scale,
            "floor_s": (ew + fft) * scale,
            "ops": {k: {"calls": v.calls, "passes": v.passes / chunk, "read_x": v.read / chunk / pattern,
                        "written_x": v.written / chunk / pattern}
                    for k, v in sorted(tally.ops.items(), key=lambda kv: -(kv[1].read + kv[1].written))}}


HEADER = ("| engine | part | passes | read MB (× pattern) | written MB (× pattern) | FFTs | calls/step "
          "| floor s/epoch (elem + FFT = total) | CPU ms/step |")


def table_line(r: dict) -> str:
    cpu = "" if r.get("cpu_s") is None else f"{1e3 * r['cpu_s']:.0f}"
    return (f"| {r['engine']} | {r['part']} | {r['passes']:.1f} | {r['read_mb']:.2f} ({r['read_x']:.1f}) "
            f"| {r['written_mb']:.2f} ({r['written_x']:.1f}) | {r['ffts']:.2f} | {r['calls']} "
            f"| {r['floor_ew_s']:.3f} + {r['floor_fft_s']:.3f} = {r['floor_s']:.3f} | {cpu} |")


def ops_lines(r: dict, top: int = 8) -> list[str]:
    out = [f"  {r['engine']} / {r['part']}: op  calls  passes  read×  written×"]
    for name, o in list(r["ops"].items())[:top]:
        out.append(f"    {name:<16} {o['calls']:>5} {o['passes']:>7.2f} {o['read_x']:>6.2f} {o['written_x']:>8.2f}")
    return out


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe-size", type=int, default=128)
    ap.add_argument("--chunk-length", type=int, default=64)
    ap.add_argument("--modes", type=int, default=4, help="probe modes of the 'modes' part")
    ap.add_argument("--slices", type=int, default=3, help="K of the 'K slices' part")
    ap.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth (H200: 4800, H100: 3350)")
    ap.add_argument("--epoch-patterns", type=int, default=262144)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    ap.add_argument("--noise", default="gaussian", choices=("gaussian", "poisson"),
                    help="noise model (AD: loss) of every engine's step")
    ap.add_argument("--no-time", action="store_true", help="skip the uncounted CPU timing")
    ap.add_argument("--whole-chunk", action="store_true",
                    help="no cache-sized sub-batches: each step over the whole chunk, as on the GPU")
    ap.add_argument("--ops", action="store_true", help="each part's operations by name, biggest first")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.engines, a.parts = a.engines.split(","), a.parts.split(",")
    bad = [e for e in a.engines if e not in ENGINES] + [p for p in a.parts if p not in PARTS]
    if bad:
        ap.error(f"unknown engine or part {bad}: engines are {', '.join(ENGINES)}; parts {', '.join(PARTS)}")
    return a


def tables(a: argparse.Namespace) -> tuple[list, list]:
    """Rows of the NumPy path and of the fused count for every engine and part asked for."""
    rows, fused_rows = [], []
    for engine in a.engines:
        for part in a.parts:
            name = part.replace("K", str(a.slices))
            counted = count_step(engine, part, a.probe_size, a.chunk_length, a.modes, a.slices, noise=a.noise)
            if counted is None:
                continue
            r = row(engine, name, counted[1], a.probe_size, a.chunk_length, a.bandwidth_gbs, a.epoch_patterns)
            r["cpu_s"] = None if a.no_time else time_step(engine, part, a.probe_size, a.chunk_length, a.modes,
                                                          a.slices, noise=a.noise)
            rows.append(r)
            fused = count_step(engine, part, a.probe_size, a.chunk_length, a.modes, a.slices, fused=True,
                               noise=a.noise)[1]
            fused_rows.append(row(engine, name, fused, a.probe_size, a.chunk_length, a.bandwidth_gbs,
                                  a.epoch_patterns))
    return rows, fused_rows


def main(argv=None) -> int:
    a = arguments(argv)
    with whole_chunks(a.whole_chunk):
        rows, fused_rows = tables(a)
    if a.json:
        print(json.dumps({"numpy": rows, "fused": fused_rows}, indent=1))
        return 0
    print(f"{a.probe_size}² patterns, chunks of {a.chunk_length}, {a.noise} noise"
          f"{' (whole-chunk steps)' if a.whole_chunk else ''}, per pattern; modes part: {a.modes} modes; "
          f"floor: {a.epoch_patterns:,} patterns at {a.bandwidth_gbs:g} GB/s")
    for title, table in (("NumPy path (CPU)", rows), ("fused kernels counted as one pass each", fused_rows)):
        print(f"\n{title}\n\n{HEADER}")
        print("|" + "---|" * (HEADER.count("|") - 1))
        for r in table:
            print(table_line(r))
    if a.ops:
        for title, table in (("NumPy path", rows), ("fused", fused_rows)):
            print(f"\noperations per pattern, {title}:")
            for r in table:
                print("\n".join(ops_lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
