#!/usr/bin/env bash
# One prepared GPU check for a machine with an NVIDIA GPU (H200 / A100) and no internet.
#
# Needs the wheels of benchmarks/fetch_gpu_wheels.sh in <repo>/.whl (carried along), a python3
# with numpy, scipy, CuPy and pytest (the GPU box image has them), and a CUDA driver.
#
# Usage, from the repository root:
#     bash benchmarks/gpu_check.sh
# Environment: OUT (the log goes to $OUT/gpu_check.log, else /tmp/gpu_check.log), WHL_DIR
# (default .whl), PYTHON
# (default python3), GPU_CHECK_BUDGET_S (default 480: steps that would start after this many
# seconds are skipped and every step's timeout is cut to what is left), EPOCHS (default 5),
# SIZES (default "16384 65536": patterns of 128x128, simulated with Poisson noise).
#
# Steps: install the wheels into /tmp/site; nvidia-smi -L; versions; the in-process GPU tests of
# tests/test_gpu.py; one simulated store per size (/tmp/gpu_check_N.zarr, shared by the benchmarks);
# bench_epoch on the GPU backend with one worker for each size (s/epoch, patterns/s, device memory,
# CuPy pool, cuFFT plan cache hits/misses read in the worker's task thread); the same with two
# workers on the one GPU (the stand-in for 2 MIG slices); bench_comm.py with those two
# workers (compute and exchange per round, a CuPy worker-to-worker transfer probe, the projection
# of docs/gpu.md; COMM_SIZE, default the smallest size); Pty-Chi's LSQML on the smallest store when a
# ptychi wheel is carried (benchmarks/gpu_peer.py); bench_ablation.py --backend gpu when the
# script exists; the bare-FFT floor of the largest size on the same worker setup; a profile of where a
# round's time goes on the worker (bench_round_profile.py); last the test on
# dask-cuda worker processes (CPU equality, spilling under a small device_memory_limit, no CUDA
# context in the client). Steps run in that order until the budget is spent (raise
# GPU_CHECK_BUDGET_S, up to ~560 within one 600 s device command, to reach the last ones).
# GPU_CHECK_SKIP: an extended regex; steps whose names match it are skipped (a second device
# command continues where the first stopped, e.g. GPU_CHECK_SKIP='in-process|gpu_diag|bench_epoch').
# A store simulated by an earlier call on the same (still warm) machine is reused.
# CHUNK_LENGTHS (default none): chunk lengths to run the largest size with on one worker, after
# the default rule's run (e.g. "6394", the host rule's chunks at 262,144: each round steps through chunk/R).
# HEAVY_SIZE (default none): run 12 probe modes x 6 slices on one worker at that size (3 epochs).
# ROUND_COST_SIZE (default none): bench_round_cost.py at that size: ms per extra round with one
# worker, and with the first of WORKERS sharing the GPU as replicas and as tiles.
# ENGINES (default "lsqml"): "lsqml ad" adds AD's bench_epoch with one worker at each size.
# WORKERS (default "2"): the counts of workers sharing the one GPU for the multi-worker bench_epoch
# steps (layout: daskpty's default, tiles where workers share a GPU, then replicas at the first count).
# PART=scale: the user's scale as its own device command: SIZES "65536 262144", WORKERS "2 4", only
# the simulations, bench_passes and the bench_epoch steps (the default PART runs everything above).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
EPOCHS="${EPOCHS:-5}"
if [ "${PART:-}" = scale ]; then
  SIZES="${SIZES:-65536 262144}"; WORKERS="${WORKERS:-2 4}"
  GPU_CHECK_SKIP="${GPU_CHECK_SKIP:-pytest|gpu_diag|bench_comm|Pty-Chi|bench_ablation|bench_fft_floor|bench_round_profile}"
fi
SIZES="${SIZES:-16384 65536}"
WORKERS="${WORKERS:-2}"
WHL_DIR="${WHL_DIR:-.whl}"
LOG="${OUT:+$OUT/gpu_check.log}"
LOG="${LOG:-/tmp/gpu_check.log}"
mkdir -p "$(dirname "$LOG")"
export PYTHONUNBUFFERED=1
START=$SECONDS
status=0

left() { echo $(( BUDGET - (SECONDS - START) )); }
step() {  # step NAME MAX_SECONDS CMD...  (runs CMD under timeout min(MAX, budget left))
  local name=$1 max=$2; shift 2
  if [ -n "${GPU_CHECK_SKIP:-}" ] && [[ "$name" =~ $GPU_CHECK_SKIP ]]; then
    echo "=== SKIP $name: GPU_CHECK_SKIP"; return
  fi
  local remain; remain=$(left)
  if [ "$remain" -lt 20 ]; then
    echo "=== SKIP $name: budget of ${BUDGET}s spent"; status=1; return
  fi
  local t=$(( max < remain ? max : remain ))
  echo "=== $name (timeout ${t}s, t+$((SECONDS - START))s)"
  timeout --kill-after=10 "$t" "$@"
  local rc=$?
  echo "=== $name: rc=$rc ($((SECONDS - START))s elapsed)"
  [ "$rc" -eq 0 ] || status=1
}

main() {
echo "=== gpu_check $(date -u +%FT%TZ) in $PWD, log $LOG"
if ! ls "$WHL_DIR"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $WHL_DIR/ (run benchmarks/fetch_gpu_wheels.sh where there is internet)"; return 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL_DIR"/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; return 2; }

nvidia-smi -L
"$PY" - <<'EOF'
import sys, importlib
print("python", sys.version.split()[0])
for name in ("numpy", "scipy", "cupy", "dask", "distributed", "zarr", "numcodecs", "dask_cuda", "psutil"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}  ({m.__file__})")
    except Exception as exc:
        print(f"{name}: IMPORT FAILED {type(exc).__name__}: {exc}")
try:
    import cupy
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion(),
          "devices", cupy.cuda.runtime.getDeviceCount())
except Exception as exc:
    print("cupy device query failed:", exc)
EOF

# Full-array passes, bytes and FFTs per pattern of each engine's chunk step (counted on the CPU;
# the fused kernels' targets), and the H200/H100 bandwidth floor they imply.
step "bench_passes: passes per pattern, 128^2" 90 "$PY" benchmarks/bench_passes.py --no-time

step "pytest -m gpu tests/test_gpu.py tests/test_kernels.py (in-process)" 260 "$PY" -m pytest -q -m gpu \
    tests/test_gpu.py tests/test_kernels.py -k "not dask_cuda" -p no:cacheprovider

# How far one CuPy chunk step is from the NumPy one, part by part (the GPU test's tolerance).
step "gpu_diag: CuPy vs NumPy chunk step" 60 "$PY" benchmarks/gpu_diag.py

# One store per size, read by every benchmark below (each would otherwise simulate its own).
data_for() {  # data_for N -> the bench_epoch/bench_comm arguments naming the data of size N
  if [ -f "/tmp/gpu_check_$1.zarr.ok" ]; then echo "--data /tmp/gpu_check_$1.zarr"
  else echo "--n-patterns $1 --probe-size 128 --tmpdir /tmp"; fi
}
# Simulated on a CPU cluster, as the benchmarks' own simulation does (daskpty's embedded default
# would be a dask-cuda cluster here).
SIMULATE='import sys, daskpty
from distributed import Client
from daskpty.execution.cluster import start_local_cluster
with start_local_cluster(gpu=False, dashboard=False) as cl, Client(cl) as c:
    daskpty.simulate(sys.argv[2], preset="small", n_patterns=int(sys.argv[1]), probe_size=128, client=c,
                     overwrite=True)
open(sys.argv[2] + ".ok", "w").close()
print("simulated", sys.argv[2])'
for n in $SIZES; do
  if [ -f "/tmp/gpu_check_${n}.zarr.ok" ]; then
    echo "=== reusing /tmp/gpu_check_${n}.zarr"; continue
  fi
  step "simulate ${n} x 128^2" $(( 120 + n / 1000 )) "$PY" -c "$SIMULATE" "$n" "/tmp/gpu_check_${n}.zarr"
done

last=""
for n in $SIZES; do
  # shellcheck disable=SC2046
  step "bench_epoch gpu ${n} x 128^2" 300 "$PY" benchmarks/bench_epoch.py --backend gpu --workers 1 \
      $(data_for "$n") --epochs "$EPOCHS" --plan-cache
  last=$n
done
# Other chunk lengths at the largest size (CHUNK_LENGTHS, e.g. "6394": the host rule's chunks at 262,144,
# beside the GPU rule's 8 chunks of 32,768).
for len_ in ${CHUNK_LENGTHS:-}; do
  [ -n "$last" ] || break
  # shellcheck disable=SC2046
  step "bench_epoch gpu ${last} x 128^2, chunks of ${len_}" 300 "$PY" benchmarks/bench_epoch.py --backend gpu \
      --workers 1 $(data_for "$last") --epochs "$EPOCHS" --plan-cache --chunk-length "$len_"
done
# A round's fixed cost per layout (the tiles' task chain beside the replicas'), when ROUND_COST_SIZE names one of SIZES.
if [ -n "${ROUND_COST_SIZE:-}" ]; then
  # shellcheck disable=SC2046
  step "bench_round_cost gpu ${ROUND_COST_SIZE} x 128^2" 300 "$PY" benchmarks/bench_round_cost.py --backend gpu \
      --workers "${WORKERS%% *}" $(data_for "$ROUND_COST_SIZE") --epochs 5
fi
# The PtyRAD paper's heavy case (12 probe modes x 6 slices) on one worker, when HEAVY_SIZE names
# one of SIZES (its patterns/s beside PtyRAD's 2,880 on a whole A100-80GB).
if [ -n "${HEAVY_SIZE:-}" ]; then
  # shellcheck disable=SC2046
  step "bench_epoch gpu ${HEAVY_SIZE} x 128^2, 12 modes x 6 slices" 300 "$PY" benchmarks/bench_epoch.py \
      --backend gpu --workers 1 $(data_for "$HEAVY_SIZE") --epochs 3 --skip 1 --probe-modes 12 --slices 6
fi
# AD beside LSQML (issue 49's "AD within 1.5x"): one worker, each size, when ENGINES names ad.
if [[ " ${ENGINES:-lsqml} " == *" ad "* ]]; then
  for n in $SIZES; do
    # shellcheck disable=SC2046
    step "bench_epoch gpu ad ${n} x 128^2" 300 "$PY" benchmarks/bench_epoch.py --backend gpu --workers 1 \
        --engine ad $(data_for "$n") --epochs "$EPOCHS" --plan-cache
  done
fi

# Several workers on the one GPU (the device listed W times: cuda_cluster starts plain dask workers,
# each with CUDA_VISIBLE_DEVICES set to it, as dask-cuda puts one worker per device): the stand-in
# for W MIG slices; compare patterns/s with the 1-worker runs. daskpty's default layout there is
# tiles; replicas once, at the first count, for the comparison.
first_w="${WORKERS%% *}"
for w in $WORKERS; do
  for n in $SIZES; do
    # shellcheck disable=SC2046
    step "bench_epoch gpu ${n} x 128^2, ${w} workers on one GPU" 240 "$PY" benchmarks/bench_epoch.py --backend gpu \
        --workers "$w" $(data_for "$n") --epochs "$EPOCHS" --plan-cache
  done
done
for n in $SIZES; do
  # shellcheck disable=SC2046
  step "bench_epoch gpu ${n} x 128^2, ${first_w} workers on one GPU, replicas" 240 "$PY" benchmarks/bench_epoch.py \
      --backend gpu --workers "$first_w" $(data_for "$n") --epochs "$EPOCHS" --plan-cache --layout replicas
done

COMM_SIZE="${COMM_SIZE:-${SIZES%% *}}"
comm_data="--sizes ${COMM_SIZE}x128 --tmpdir /tmp"
[ -f "/tmp/gpu_check_${COMM_SIZE}.zarr.ok" ] && comm_data="--data /tmp/gpu_check_${COMM_SIZE}.zarr"
# shellcheck disable=SC2086
step "bench_comm gpu ${COMM_SIZE} x 128^2, 2 workers on one GPU, replicas and tiles" 300 "$PY" benchmarks/bench_comm.py --backend gpu \
    --workers 2 $comm_data --rounds 1,4 --epochs 4 --layouts replicas,tiles --probe-bytes 64e6,256e6 --project --json

# Pty-Chi on the same GPU, on the first size's store, scored like bench_epoch scores daskpty
# (s/epoch, NRMSE after EPOCHS): its wheel (and pydantic's) must be carried in $WHL_DIR; torch is the box's.
if ! ls "$WHL_DIR"/ptychi-*.whl >/dev/null 2>&1; then
  echo "=== Pty-Chi: not carried (no ptychi wheel in $WHL_DIR/)"
elif ! "$PY" -c "import torch, ptychi, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "=== Pty-Chi: not run (ptychi or a CUDA torch does not import here)"
elif [ ! -f "/tmp/gpu_check_${SIZES%% *}.zarr.ok" ]; then
  echo "=== Pty-Chi: not run (no simulated store of ${SIZES%% *} patterns)"
else
  step "Pty-Chi LSQML on the GPU, ${SIZES%% *} x 128^2" 150 "$PY" benchmarks/gpu_peer.py \
      "/tmp/gpu_check_${SIZES%% *}.zarr" --epochs "$EPOCHS" --device cuda
fi

if [ -f benchmarks/bench_ablation.py ]; then
  # Cumulative only, on a mid-size set: "all off" builds a cuFFT plan for every single-pattern call.
  step "bench_ablation gpu 4096 x 128^2 (cumulative)" 240 "$PY" benchmarks/bench_ablation.py --backend gpu \
      --workers 1 --n-patterns 4096 --probe-size 128 --tmpdir /tmp --epochs 3 --only cumulative
else
  echo "=== SKIP bench_ablation: benchmarks/bench_ablation.py is not in this tree"
fi

if [ -n "$last" ]; then
  step "bench_fft_floor gpu ${last} x 128^2" 120 "$PY" benchmarks/bench_fft_floor.py --backend gpu --workers 1 \
      --n-patterns "$last" --probe-size 128 --repeat 5
fi

# Where a round's time goes on the GPU worker (dask's profiler in the worker; 16 rounds/epoch).
if [ -n "$last" ]; then
  # shellcheck disable=SC2046
  step "bench_round_profile gpu ${SIZES%% *} x 128^2, 16 rounds" 120 "$PY" benchmarks/bench_round_profile.py \
      --backend gpu $(data_for "${SIZES%% *}") --epochs 3 --rounds-per-epoch 16 --top 20
fi

# Last, as it starts dask-cuda worker processes three times (a test in a subprocess, ~1-2 min).
step "pytest -m gpu tests/test_gpu.py (dask-cuda workers)" 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py \
    -k "dask_cuda" -p no:cacheprovider

echo "=== gpu_check done in $((SECONDS - START))s, status $status"
return $status
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
