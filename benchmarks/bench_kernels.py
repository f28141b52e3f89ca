"""Where the CPU chunk step spends its time: FFTs vs the element-wise chains of daskpty.physics.kernels,
and what a fused CPU (numba) version of the biggest chain would save.

Usage (not run in CI; one process, one thread, a few seconds per case):

    python benchmarks/bench_kernels.py [--n 128] [--patterns 100] [--modes 1 2] [--repeat 9]
    # numba comparison: numba in a throwaway venv (not a daskpty dependency), daskpty on the path
    PYTHONPATH=. /tmp/nbvenv/bin/python benchmarks/bench_kernels.py --numba

Each case runs ``lsqml.chunk_step`` (Gaussian and Poisson, probe updated) and ``ad.chunk_gradient``
(Gaussian) on one simulated chunk with the kernels' functions and the in-place FFTs wrapped by
timers, and prints, per case, the chunk step's time, its FFT time and each chain's time (those of
the fastest of --repeat runs, after one warm-up), in ms and as a share of the step. With --numba it
also times a numba-fused version of the LSQML far-field update (both noise models) on the same
blocks, checks it against the NumPy reference, and prints the saving as a share of the step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from functools import partial

# One BLAS thread, as distributed's nanny sets for every worker process (pre-spawn-environ). With
# OpenBLAS's default threads a busy second core makes each small dot product wait for a time slice:
# measured here, the Poisson α's dots on 8 × 128² patterns took 2.5 s instead of 2.2 ms.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

CHAINS = ("far_field_update", "far_field_loss", "object_gradient", "conj_product", "step_dots",
          "object_step_dots")


class Timers:
    """Wraps module attributes with accumulating timers; ``restore`` puts the originals back."""

    def __init__(self):
        self.total = defaultdict(float)
        self._saved = []

    def wrap(self, module, name, label):
        original = getattr(module, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.total[label] += time.perf_counter() - t0

        self._saved.append((module, name, original))
        setattr(module, name, timed)

    def restore(self):
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


def _instrument(timers):
    from daskpty.engines import forward_model, lsqml
    from daskpty.engines.ad import gradient
    from daskpty.physics import kernels

    for chain in CHAINS:
        timers.wrap(kernels, chain, chain)
    for module in (forward_model, lsqml, gradient):  # every FFT of both steps (the forward model's and the probe sums')
        for name in ("fft2", "ifft2"):
            if hasattr(module, name):
                timers.wrap(module, name, "fft")


def _chunk(n, patterns, modes, seed=0):
    from synthetic import make_dataset

    grid = int(round(np.sqrt(patterns)))
    ds = make_dataset(n=n, grid=grid, step=n / 6, modes=modes, seed=seed)
    y = np.fft.ifftshift(ds.intensities, axes=(-2, -1)).astype(np.float32)
    return ds.truth.object * np.complex64(0.9), ds.truth.probe, y, ds.positions


def profile_case(label, run, repeat):
    """The fastest of ``repeat`` runs (one warm-up first), with its timers: on a shared machine the
    least disturbed run, and one whose parts add up to its total."""
    run()
    best = None
    for _ in range(repeat):
        timers = Timers()
        _instrument(timers)
        t0 = time.perf_counter()
        try:
            run()
        finally:
            step = time.perf_counter() - t0
            timers.restore()
        if best is None or step < best["step"]:
            best = {"step": step, **timers.total}
    return best


def print_profile(label, prof):
    step = prof["step"]
    parts = [("fft", prof.get("fft", 0.0))] + [(c, prof[c]) for c in CHAINS if c in prof]
    rest = step - sum(t for _, t in parts)
    print(f"  {label}: step {step * 1e3:.1f} ms, FFT {prof.get('fft', 0.0) * 1e3:.1f} ms "
          f"(step / FFT = {step / max(prof.get('fft', 1e-30), 1e-30):.2f})")
    for name, t in parts[1:] + [("other (gathers, scatters, ramps, sums)", rest)]:
        print(f"    {name:40s} {t * 1e3:8.1f} ms  {100 * t / step:5.1f} %")


# --------------------------------------------------------------------------------------------------
# numba: the LSQML far-field update fused per block (one thread, as a dask worker thread runs it)

def _numba_far_field_update():
    """The LSQML far-field update (no mask, no background) fused per pattern: one pass for ŷ, the
    loss and g, the Newton steps of α over per-pattern float64 buffers, one pass scaling Ψ.
    fastmath lets LLVM vectorise the sums (the fastest of the variants tried)."""
    import numba

    @numba.njit(fastmath=True)
    def gaussian(farf, y, eps, yhat, loss):
        b, m, npix2 = farf.shape  # float32 view of the complex64 far fields: re, im interleaved
        npix = npix2 // 2
        fac = np.empty(npix, np.float32)
        for j in range(b):
            acc = 0.0
            for i in range(npix):
                s = np.float32(0.0)
                for k in range(m):
                    re, im = farf[j, k, 2 * i], farf[j, k, 2 * i + 1]
                    s += re * re + im * im
                yhat[j, i] = s
                level = np.sqrt(s + eps)
                r = np.sqrt(y[j, i]) - level
                acc += r * r
                fac[i] = r / level
            for k in range(m):
                for i in range(npix2):
                    farf[j, k, i] *= fac[i // 2]
            loss[j] = acc

    @numba.njit(fastmath=True)
    def poisson(far, y, eps, yhat, loss, iterations):
        b, m, npix = far.shape
        g, h, yy = np.empty(npix), np.empty(npix), np.empty(npix)
        for j in range(b):
            acc = 0.0
            curv = 0.0
            for i in range(npix):
                s = np.float32(0.0)
                for k in range(m):
                    c = far[j, k, i]
                    s += c.real * c.real + c.imag * c.imag
                yhat[j, i] = s
                hd, yd = np.float64(s), np.float64(y[j, i])
                h[i], yy[i] = hd, yd
                acc += hd - yd * np.log(hd + eps)
                gg = 1.0 - yd / (hd + eps)
                g[i] = gg
                curv += gg * gg * hd
            loss[j] = acc
            alpha = 0.5
            for _ in range(iterations):
                d1 = 0.0
                d2 = 0.0
                for i in range(npix):
                    gg = g[i]
                    u = 1.0 - alpha * gg
                    u = u if u > 1e-6 else 1e-6
                    inv = 1.0 / u
                    yg = yy[i] * gg
                    d1 += yg * inv - gg * h[i] * u
                    d2 += yg * gg * inv * inv
                alpha = min(max(alpha - d1 / max(curv + d2, 1e-30), 0.0), 1.0)
            for i in range(npix):
                f = np.float32(-alpha * g[i])
                for k in range(m):
                    far[j, k, i] *= f

    def update(noise, far, y, valid, eps):
        if valid is not None:
            raise ValueError("the numba comparison runs without a mask")
        b, m, ny, nx = far.shape
        flat, y2 = far.reshape(b, m, ny * nx), y.reshape(b, ny * nx)
        yhat = np.empty((b, ny * nx), np.float32)
        loss = np.empty(b)
        if noise == "gaussian":
            gaussian(flat.view(np.float32), y2, np.float32(eps), yhat, loss)
        else:
            poisson(flat, y2, eps, yhat, loss, 10)
        return far, yhat.reshape(b, ny, nx), loss

    return update


def numba_comparison(n, patterns, modes, repeat, step_s):
    """Time the far-field update per block in NumPy and fused by numba on the chunk's own far fields."""
    from daskpty.engines.lsqml import CPU_BLOCK_BYTES
    from daskpty.physics import fft2, kernels

    variants = {"numba": _numba_far_field_update()}
    obj, probe, y, positions = _chunk(n, patterns, modes)
    from daskpty.physics.forward import exit_waves
    from daskpty.physics.shifts import shift_ramps, split_positions

    corners, fractions = split_positions(positions, n)
    psi, _, _ = exit_waves(obj, probe, corners, shift_ramps(fractions, n))
    far = fft2(psi).astype(np.complex64)
    step = max(1, min(patterns, CPU_BLOCK_BYTES // (8 * modes * n * n)))
    blocks = [slice(s, min(s + step, far.shape[0])) for s in range(0, far.shape[0], step)]

    reference = lambda *a: kernels.far_field_update(*a, overwrite=True)  # noqa: E731
    for noise in ("gaussian", "poisson"):
        ref = [reference(noise, far[b].copy(), y[b], None, 1e-6) for b in blocks]
        runs = {"NumPy": reference, **variants}
        for name, update in variants.items():  # compile, and check against the reference
            fused = [update(noise, far[b].copy(), y[b], None, 1e-6) for b in blocks]
            err = max(float(np.linalg.norm(f[0] - r[0]) / np.linalg.norm(r[0])) for f, r in zip(fused, ref))
            lerr = max(float(np.abs(f[2] - r[2]).max() / np.abs(r[2]).max()) for f, r in zip(fused, ref))
            print(f"    {name}: max rel. diff vs NumPy: delta {err:.1e}, loss {lerr:.1e}")
        best = dict.fromkeys(runs, np.inf)
        for _ in range(repeat):  # interleaved, so that every variant sees the same machine
            for name, update in runs.items():
                work = [far[b].copy() for b in blocks]
                t0 = time.perf_counter()
                for b, w in zip(blocks, work):
                    update(noise, w, y[b], None, 1e-6)
                best[name] = min(best[name], time.perf_counter() - t0)
        t_ref = best["NumPy"]
        print(f"  far_field_update {noise}: NumPy {t_ref * 1e3:.1f} ms")
        for name in variants:
            saved = t_ref - best[name]
            print(f"    {name:15s} {best[name] * 1e3:7.1f} ms (x{t_ref / best[name]:.2f}); saves "
                  f"{saved * 1e3:.1f} ms = {100 * saved / step_s[noise]:.1f} % of the chunk step")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=128, help="pattern size n (n × n)")
    ap.add_argument("--patterns", type=int, default=100, help="patterns in the chunk (a square grid)")
    ap.add_argument("--modes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--numba", action="store_true", help="also time a numba-fused far-field update")
    args = ap.parse_args(argv)

    from daskpty.engines import ad, lsqml

    print(f"chunk of {args.patterns} patterns of {args.n}², CPU, one thread (BLAS threads: "
          f"{os.environ['OPENBLAS_NUM_THREADS']}, numpy {np.__version__}); fastest of {args.repeat} runs")
    for modes in args.modes:
        obj, probe, y, positions = _chunk(args.n, args.patterns, modes)
        print(f"modes = {modes} ({y.shape[0]} patterns)")
        step_s = {}
        for noise in ("gaussian", "poisson"):
            opts = lsqml.LSQMLOptions(noise=noise)
            prof = profile_case(noise, partial(lsqml.chunk_step, obj, probe, y, positions, options=opts),
                                args.repeat)
            step_s[noise] = prof["step"]
            print_profile(f"LSQML {noise}", prof)
        prof = profile_case("ad", partial(ad.chunk_gradient, obj, probe, y, positions), args.repeat)
        print_profile("AD gaussian", prof)
        if args.numba:
            try:
                import numba  # noqa: F401
            except ImportError:
                print("  --numba: numba is not importable here (run with a throwaway venv that has it)")
                continue
            numba_comparison(args.n, args.patterns, modes, args.repeat, step_s)


if __name__ == "__main__":
    main()
