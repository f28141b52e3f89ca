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
# tests/test_gpu.py; bench_epoch on the GPU backend with one worker for each size (s/epoch,
# patterns/s, device memory, CuPy pool, cuFFT plan cache hits/misses read in the worker's task
# thread); the bare-FFT floor of the largest size on the same worker setup; last the test on
# dask-cuda worker processes (CPU equality, spilling under a small device_memory_limit, no CUDA
# context in the client).
set -u -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
EPOCHS="${EPOCHS:-5}"
SIZES="${SIZES:-16384 65536}"
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

step "pytest -m gpu tests/test_gpu.py (in-process)" 200 "$PY" -m pytest -q -m gpu tests/test_gpu.py \
    -k "not dask_cuda" -p no:cacheprovider

last=""
for n in $SIZES; do
  step "bench_epoch gpu ${n} x 128^2" 300 "$PY" benchmarks/bench_epoch.py --backend gpu --workers 1 \
      --n-patterns "$n" --probe-size 128 --epochs "$EPOCHS" --tmpdir /tmp --plan-cache
  last=$n
done

if [ -n "$last" ]; then
  step "bench_fft_floor gpu ${last} x 128^2" 120 "$PY" benchmarks/bench_fft_floor.py --backend gpu --workers 1 \
      --n-patterns "$last" --probe-size 128 --repeat 5
fi

# Last, as it starts dask-cuda worker processes three times (a test in a subprocess, ~1-2 min).
step "pytest -m gpu tests/test_gpu.py (dask-cuda workers)" 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py \
    -k "dask_cuda" -p no:cacheprovider

echo "=== gpu_check done in $((SECONDS - START))s, status $status"
return $status
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
