#!/usr/bin/env python
"""A thick electron ptychography scan simulated by abTEM (independent of daskpty), with scan errors.

Run with the abTEM virtualenv, never with daskpty's own (it writes plain .npz that daskpty reads)::

    python3 -m venv /work/abtem-venv && /work/abtem-venv/bin/pip install abtem ase
    /work/abtem-venv/bin/python benchmarks/electron_abtem.py -o /tmp/electron.npz

Sample: SrTiO3 [001], ``--cells`` x ``--cells`` unit cells laterally (periodic) and ``--slabs x --slab-cells``
deep (default 3 x 5 cells = 5.9 nm; ``--slabs K`` slabs of ``--slab-cells``), one frozen configuration:
``--vacancies`` of the Sr and Ti atoms removed at random and every atom displaced by N(0,
``--displacement``) Å, so the slabs differ from each other (a perfect crystal's slabs would be
identical). abTEM's potential (Lobato,
infinite projection, slices of c/2) on a grid of half the object pixel; abTEM's multislice of a
converged probe (``--energy``, ``--semiangle``, ``--defocus``) through all slices, far-field
diffraction patterns.

Detector: patterns of n x n pixels whose angular pixel is 1/(n dx) (dx the object pixel of the
reconstruction). abTEM's periodic cell is L = 3 n dx wide, so its patterns have three samples per
detector pixel: ``--detector bin`` sums 3 x 3 of them (what a pixel detector records; default),
``point`` keeps the centre one (daskpty's model exactly, for a wave inside the window). Then the
dose (electrons per Å^2 over the scan step's area per pattern) and Poisson noise.

Ground truth on the reconstruction's grid (dx): per slab k (entrance first), the transmission
exp(i sigma V_k) with V_k the sum of abTEM's projected slice potentials of that slab, band-limited to
the detector's extent (Fourier crop); the true probe (abTEM's, band-limited, n x n window centred on
the beam, sum |P|^2 = electrons per pattern).

Positions (y, x) in object pixels of the truth grid (abTEM's x axis is the first array axis, so
row = abTEM x, column = abTEM y): the true scan is a ``--grid`` x ``--grid`` raster of ``--step`` px
plus N(0, ``--jitter``) px; the nominal scan is the true one scaled by 1 + ``--scale``, rotated by
``--rotation`` deg about the scan centre, plus N(0, ``--noise-rms``) px per axis (as
benchmarks/_positions.perturb).

Output .npz: intensities (B, n, n) float32, DC at the pattern centre (index n/2, as daskpty.from_arrays
wants); clean_intensities (noise free); positions_true, positions_nominal (B, 2); truth_slabs
(K, H, W) complex64; truth_probe (1, n, n) complex64; pixel_size_m, wavelength_m, slab_thickness_m,
energy_ev, semiangle_rad, defocus_m, dose, electrons_per_pattern, settings (JSON), abtem_version.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def fourier_crop(x, m):
    """Band-limit the last two axes to the central m x m frequencies (values kept: same mean)."""
    g = x.shape[-1]
    f = np.fft.fftshift(np.fft.fft2(x), axes=(-2, -1))
    lo = g // 2 - m // 2
    f = f[..., lo:lo + m, lo:lo + m]
    return np.fft.ifft2(np.fft.ifftshift(f, axes=(-2, -1))) * (m / g) ** 2


def detector(patterns, n, mode):
    """Fine fft-shifted patterns (B, 3n, 3n... of any G with DC at G/2) -> (B, n, n), DC at n/2."""
    g = patterns.shape[-1]
    c = g // 2
    if mode == "point":
        idx = c + 3 * (np.arange(n) - n // 2)
        return patterns[:, idx][:, :, idx]
    lo = c - 3 * (n // 2) - 1  # bin b covers fine offsets 3(b - n/2) - 1 ... + 1 from DC
    crop = patterns[:, lo:lo + 3 * n, lo:lo + 3 * n]
    return crop.reshape(len(crop), n, 3, n, 3).sum(axis=(2, 4))


def sample(args, rng):
    from ase.spacegroup import crystal

    a = 3.905
    sto = crystal(["Sr", "Ti", "O"], basis=[(0, 0, 0), (0.5, 0.5, 0.5), (0.5, 0.5, 0)], spacegroup=221,
                  cellpar=[a, a, a, 90, 90, 90])
    atoms = sto * (args.cells, args.cells, args.slabs * args.slab_cells)
    symbols = np.array(atoms.get_chemical_symbols())
    drop = np.isin(symbols, ["Sr", "Ti"]) & (rng.random(len(atoms)) < args.vacancies)
    del atoms[np.flatnonzero(drop)]
    atoms.positions += rng.normal(0, args.displacement, atoms.positions.shape)
    atoms.wrap()
    return atoms, a


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--n", type=int, default=64, help="pattern size (detector pixels)")
    ap.add_argument("--cells", type=int, default=10, help="lateral unit cells (periodic cell = 3 n dx)")
    ap.add_argument("--slabs", type=int, default=3, help="slabs (the truth's slices)")
    ap.add_argument("--slab-cells", type=int, default=5, help="unit cells per slab")
    ap.add_argument("--slices-per-slab", type=int, default=None,
                    help="abTEM slices per slab (default 2 per unit cell, c/2; 1: abTEM's multislice is the "
                         "3-slice model daskpty reconstructs with, no slicing error between them)")
    ap.add_argument("--energy", type=float, default=300e3, help="eV")
    ap.add_argument("--semiangle", type=float, default=25.0, help="mrad")
    ap.add_argument("--defocus", type=float, default=100.0, help="Å (abTEM's defocus = -C10)")
    ap.add_argument("--grid", type=int, default=24, help="grid x grid positions")
    ap.add_argument("--step", type=float, default=5.0, help="scan step, object pixels")
    ap.add_argument("--jitter", type=float, default=0.3, help="true scan: N(0, px) per axis on the raster")
    ap.add_argument("--dose", type=float, default=1e5, help="electrons per Å^2")
    ap.add_argument("--vacancies", type=float, default=0.15)
    ap.add_argument("--displacement", type=float, default=0.06, help="Å rms per axis")
    ap.add_argument("--detector", choices=("bin", "point"), default="bin")
    ap.add_argument("--scale", type=float, default=0.015)
    ap.add_argument("--rotation", type=float, default=1.0, help="deg")
    ap.add_argument("--noise-rms", type=float, default=0.5, help="px per axis")
    ap.add_argument("--batch", type=int, default=48, help="positions per abTEM call")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import abtem

    t0 = time.perf_counter()
    abtem.config.set({"device": "cpu", "dask.lazy": False})
    rng = np.random.default_rng(args.seed)
    n = args.n
    atoms, a = sample(args, rng)
    cell = args.cells * a
    h = 3 * n  # object grid: the cell L = 3 n dx, so one detector pixel 1/(n dx) = 3 of abTEM's 1/L
    dx = cell / h
    fine = 2 * h  # abTEM runs at dx / 2 (its anti-aliasing keeps 2/3 of that Nyquist > ours)
    per_slab = args.slices_per_slab or 2 * args.slab_cells
    slice_thickness = args.slab_cells * a / per_slab
    pot = abtem.Potential(atoms, gpts=(fine, fine), slice_thickness=slice_thickness, projection="infinite")
    assert pot.num_slices == args.slabs * per_slab, (pot.num_slices, per_slab)
    potential = pot.build().compute()
    v = np.asarray(potential.array, dtype=np.float64)  # (slices, fine, fine) V·Å
    sigma = abtem.core.energy.energy2sigma(args.energy)  # rad / (V Å)
    slabs = v.reshape(args.slabs, per_slab, fine, fine).sum(axis=1)
    truth = fourier_crop(np.exp(1j * sigma * slabs), h).astype(np.complex64)
    t_pot = time.perf_counter() - t0

    # scan (object pixels; the probe centre sits at pixel p, abTEM position p * dx in Å)
    g = (np.arange(args.grid) - (args.grid - 1) / 2) * args.step
    true = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2) + h / 2
    true = true + rng.normal(0, args.jitter, true.shape)
    lo, hi = true.min(), true.max()
    if lo - n / 2 < 1 or hi + n / 2 > h - 1:
        raise SystemExit(f"scan windows leave the periodic cell ({h} px): smaller --grid or --step")
    centre = true.mean(axis=0)
    t = np.radians(args.rotation)
    m = (1 + args.scale) * np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
    nominal = (true - centre) @ m.T + centre + rng.normal(0, args.noise_rms, true.shape)

    probe = abtem.Probe(energy=args.energy, semiangle_cutoff=args.semiangle, defocus=args.defocus)
    probe.grid.match(pot)
    per_pattern = args.dose * (args.step * dx) ** 2
    clean = np.empty((len(true), n, n), np.float64)
    for s in range(0, len(true), args.batch):
        scan = abtem.CustomScan(true[s:s + args.batch] * dx)
        exit_waves = probe.multislice(pot, scan=scan)
        dp = exit_waves.diffraction_patterns(max_angle=None, block_direct=False, fftshift=True)
        arr = np.asarray(dp.compute().array if hasattr(dp, "compute") else dp.array, dtype=np.float64)
        clean[s:s + args.batch] = detector(arr.reshape(-1, fine, fine), n, args.detector)
        print(f"  patterns {min(s + args.batch, len(true))}/{len(true)}  {time.perf_counter() - t0:.0f} s",
              flush=True)
    clean *= per_pattern  # abTEM: each pattern sums to 1 (less what leaves its anti-aliasing band)
    intensities = rng.poisson(clean).astype(np.float32)

    wave = np.asarray(probe.build((cell / 2, cell / 2)).compute().array, dtype=np.complex128)
    wave = fourier_crop(wave, h)
    c = h // 2
    window = wave[c - n // 2:c + n // 2, c - n // 2:c + n // 2]
    window = window * np.sqrt(per_pattern / (np.abs(window) ** 2).sum())
    lam = float(abtem.core.energy.energy2wavelength(args.energy))
    settings = dict(vars(args), object_pixel_angstrom=dx, cell_angstrom=cell, sim_pixel_angstrom=dx / 2,
                    slices=int(pot.num_slices), atoms=len(atoms))
    np.savez_compressed(
        args.output, intensities=intensities, clean_intensities=clean.astype(np.float32),
        positions_true=true, positions_nominal=nominal, truth_slabs=truth,
        truth_probe=window[None].astype(np.complex64), pixel_size_m=dx * 1e-10, wavelength_m=lam * 1e-10,
        slab_thickness_m=per_slab * slice_thickness * 1e-10, energy_ev=args.energy,
        semiangle_rad=args.semiangle * 1e-3, defocus_m=args.defocus * 1e-10, dose=args.dose,
        electrons_per_pattern=per_pattern, settings=json.dumps(settings), abtem_version=abtem.__version__)
    d = nominal - true
    d -= d.mean(axis=0)
    print(f"wrote {args.output}: {len(true)} patterns of {n}x{n} ({args.detector}), object {h}x{h} px of "
          f"{dx:.4f} Å, {args.slabs} slabs of {per_slab * slice_thickness / 10:.3f} nm ({pot.num_slices} abTEM slices, "
          f"{len(atoms)} atoms), {per_pattern:.3g} e/pattern, lambda {lam:.4g} Å; nominal positions "
          f"{np.sqrt((d ** 2).sum(1).mean()):.3f} px rms off (offset removed); potential {t_pot:.0f} s, "
          f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
