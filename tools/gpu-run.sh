#!/usr/bin/env bash
# Runs on a CUDA machine from the repo root (with .deps from tools/gpu-prep.sh when the machine
# lacks the -dev packages): configure and build the CUDA build, run the tests, optionally the
# benchmark. CUDA_ARCH (default 90: Hopper, sm_90a) and JOBS (default: every core) as in the
# Makefile; Ninja when it is installed.
#   bash tools/gpu-run.sh test            build + ctest (all tests, GPU ones included)
#   bash tools/gpu-run.sh test REGEX      build + ctest -R REGEX
#   bash tools/gpu-run.sh bench           build + make bench (ours and the PyTorch reference)
# Logs go to $OUT (or out/ when unset).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.deps/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
what=${1:-test}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
GEN=(); command -v ninja > /dev/null && GEN=(-G Ninja)
cmake -S . -B build "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_CUDA_ARCH="${CUDA_ARCH:-90}" \
  > "$OUT/configure.log" 2>&1 || { tail -50 "$OUT/configure.log"; exit 1; }
cmake --build build -j "${JOBS:-$(nproc)}" > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -60; exit 1; }
echo "build ok"
case "$what" in
  test)
    (cd build && OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} ctest --output-on-failure -j 4 ${2:+-R "$2"}) > "$OUT/test.log" 2>&1
    rc=$?
    tail -60 "$OUT/test.log"
    exit $rc ;;
  bench)
    bash bench/run.sh build 2>&1 | tee "$OUT/bench.log" ;;
  *) shift; "$@" ;;
esac
