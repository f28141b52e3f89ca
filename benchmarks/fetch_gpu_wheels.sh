#!/usr/bin/env bash
# Download, on a machine with internet, the wheels an offline GPU box needs to run daskpty's
# GPU checks (benchmarks/gpu_check.sh), for CPython 3.12 on manylinux x86_64, into .whl/.
#
# Usage (from anywhere; writes <repo>/.whl, which is git-ignored):
#     bash benchmarks/fetch_gpu_wheels.sh              # what the GPU box lacks + pinned small deps
#     bash benchmarks/fetch_gpu_wheels.sh --minimal    # only what the GPU box image lacks
#     bash benchmarks/fetch_gpu_wheels.sh --with-bokeh # + bokeh (dask dashboard) and its deps
#     bash benchmarks/fetch_gpu_wheels.sh --with-gpu-stack  # + numpy, cupy-cuda12x, cuda-core,
#                                                        #   nvidia-ml-py, pandas (a bare box; >100 MiB)
# Environment: PIP (default: python3 -m pip), PYVER (default 3.12), WHL_DIR (default <repo>/.whl).
#
# Versions are pinned to the development venv's (dask 2026.8.0, zarr 3.1.6, ...). dask-cuda 26.10
# is installed with --no-deps: its rapids-dask-dependency pins dask/distributed 2026.7.1, but
# dask_cuda imports and runs on 2026.8.0 (it never imports rapids_dask_dependency; that package's
# .pth hook is not even read from a --target folder on PYTHONPATH).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHL_DIR="${WHL_DIR:-$ROOT/.whl}"
PYVER="${PYVER:-3.12}"
read -r -a PIP <<<"${PIP:-python3 -m pip}"

# Missing from the GPU box image (see the device notes: it has numpy, scipy, cupy-cuda13x,
# cuda-core, nvidia-ml-py, pandas, psutil, pyyaml, jinja2, click, ... but no dask stack).
REQUIRED=(
  dask==2026.8.0
  distributed==2026.8.0
  zarr==3.1.6
  numcodecs==0.16.6
  donfig==0.8.1.post1
  google-crc32c==1.9.0        # zarr 3.1 needs it (sharding index checksums)
  partd==1.4.2
  locket==1.0.0
  tblib==3.2.2
  tornado==6.6.1
  zict==3.0.0
  importlib_metadata==10.2.0
  dask-cuda==26.10.0
  rapids-dask-dependency==26.10.0
)
# Present on the box too, carried pinned so the dask stack sees the versions it was tested with.
COMMON=(
  toolz==1.2.0
  cloudpickle==3.1.3
  msgpack==1.2.4
  sortedcontainers==2.4.0
  psutil==7.2.2
  click==8.5.1
  pyyaml==6.0.4
  jinja2==3.1.6
  markupsafe==3.0.4
  packaging==26.4
  zipp==4.1.2
  typing_extensions==4.16.0
  fsspec==2026.9.0
)
BOKEH=(bokeh==3.9.2 xyzservices==2026.9.1 narwhals==2.29.0 contourpy==1.3.3 pillow==13.0.0)
# A box without a CUDA Python stack. cupy-cuda12x alone is over 100 MiB.
GPU_STACK=(numpy==2.4.6 cupy-cuda12x fastrlock cuda-core cuda-bindings cuda-pathfinder nvidia-ml-py
           pandas python-dateutil six tzdata)

NAMES=("${REQUIRED[@]}")
minimal=0
for arg in "$@"; do
  case "$arg" in
    --minimal) minimal=1 ;;
    --with-bokeh) NAMES+=("${BOKEH[@]}") ;;
    --with-gpu-stack) NAMES+=("${GPU_STACK[@]}") ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
[ "$minimal" = 1 ] || NAMES+=("${COMMON[@]}")

mkdir -p "$WHL_DIR"
failed=()
for spec in "${NAMES[@]}"; do
  if ! "${PIP[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
      -d "$WHL_DIR" "$spec" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); then
    failed+=("$spec")
  fi
done

echo "wheels in $WHL_DIR:"
ls -1 "$WHL_DIR"/*.whl | xargs -n1 basename
# Two versions of one project stop the offline install; say so now.
dups=$(ls -1 "$WHL_DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dups" ] || { echo "ERROR: more than one wheel of: $dups" >&2; failed+=(duplicates); }
total=$(du -cb "$WHL_DIR"/*.whl | tail -1 | cut -f1)
echo "total: $total bytes ($(( (total + 1048575) / 1048576 )) MiB) in $(ls -1 "$WHL_DIR"/*.whl | wc -l) wheels"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "FAILED: ${failed[*]}" >&2
  exit 1
fi
