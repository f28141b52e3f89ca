#!/usr/bin/env bash
# The abTEM electron scans of docs/benchmarks.md (bench_electron.py), written to DIR (default
# electron_sets/): SrTiO3 slabs with scan errors, made with benchmarks/electron_abtem.py in
# abTEM's own virtualenv (README_ptychi.md). Usage: bash benchmarks/electron_sets.sh [DIR] [PYTHON]
set -euo pipefail
dir=${1:-electron_sets}
py=${2:-${ABTEM_PYTHON:-/work/abtem-venv/bin/python}}
make="$py $(dirname "$0")/electron_abtem.py"
mkdir -p "$dir"
common="--grid 18 --step 4 --scale 0.01 --rotation 1 --noise-rms 0.4"
# the tuning sets
for seed in 1 2 3; do $make -o "$dir/t3_s$seed.npz" $common --seed $seed; done
for seed in 1 2; do $make -o "$dir/t2_s$seed.npz" --slabs 2 --slab-cells 3 $common --seed $seed; done
$make -o "$dir/t3b_s4.npz" --grid 20 --step 3 --slab-cells 4 --scale 0.015 --rotation -1.5 --noise-rms 0.3 --defocus 80 --seed 4
$make -o "$dir/t3d_s5.npz" --grid 20 --step 2.5 --slab-cells 6 --dose 3e4 --scale 0.012 --rotation 1.2 --noise-rms 0.4 --defocus 150 --seed 5
# made apart from the tuning of the low-dose defaults
$make -o "$dir/d3e5.npz" $common --dose 3e5 --semiangle 20 --defocus 60 --seed 7
$make -o "$dir/d1e6.npz" $common --dose 1e6 --semiangle 20 --defocus 60 --seed 8
$make -o "$dir/d3e4_2slab.npz" --slabs 2 --slab-cells 4 --grid 18 --step 4 --dose 3e4 --semiangle 30 --defocus 80 \
    --scale 0.012 --rotation -1 --noise-rms 0.3 --seed 9
$make -o "$dir/d1e5_4slab.npz" --slabs 4 --slab-cells 4 --grid 18 --step 4 --scale 0.008 --rotation 1.5 --noise-rms 0.4 --seed 10
# made apart from the --noise poisson comparison (h4: sliced as the model slices)
$make -o "$dir/h1.npz" --slabs 2 --slab-cells 5 --dose 5e4 --semiangle 22 --defocus 120 --grid 18 --step 4 --scale 0.01 \
    --rotation 0.8 --noise-rms 0.35 --seed 11
$make -o "$dir/h2.npz" --slabs 3 --slab-cells 3 --dose 2e4 --semiangle 28 --defocus 90 --grid 20 --step 3 --scale 0.012 \
    --rotation -1.2 --noise-rms 0.3 --seed 12
$make -o "$dir/h3.npz" --slab-cells 4 --defocus 50 --grid 18 --step 4 --scale 0.008 --rotation 1.0 --noise-rms 0.4 --seed 13
$make -o "$dir/h4.npz" --slabs 2 --slab-cells 4 --slices-per-slab 1 --dose 3e4 $common --seed 14
# made apart from everything above: scan errors beyond the tuned range (3 % and -2 % scale, 2 deg), none (noise only)
$make -o "$dir/u1.npz" --slabs 3 --slab-cells 4 --grid 18 --step 4 --scale 0.03 --rotation 2 --noise-rms 0.4 --defocus 120 --seed 21
$make -o "$dir/u2.npz" --slabs 4 --slab-cells 3 --grid 18 --step 4 --scale -0.02 --rotation -2 --noise-rms 0.5 --dose 5e4 \
    --semiangle 22 --defocus 60 --seed 22
$make -o "$dir/u3.npz" --slabs 2 --slab-cells 5 --grid 18 --step 3.5 --scale 0.0 --rotation 0 --noise-rms 0.6 --seed 23
# made apart from the tuning of every default: small scale errors (0.5 %, -1 %)
$make -o "$dir/v1.npz" --slabs 3 --slab-cells 3 --grid 18 --step 4 --scale 0.005 --rotation 1 --noise-rms 0.5 --semiangle 25 \
    --defocus 100 --seed 41
$make -o "$dir/v2.npz" --slabs 2 --slab-cells 4 --grid 18 --step 4 --scale -0.01 --rotation -1.5 --noise-rms 0.4 --dose 1e5 --seed 42
