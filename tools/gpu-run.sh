#!/usr/bin/env bash
# Runs on the GPU machine from the repo root (after tools/gpu-prep.sh here, with .deps
# carried): configure and build the CUDA build, run the GPU tests, optionally the benchmark.
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
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_CUDA_ARCH=90 \
  > "$OUT/configure.log" 2>&1 || { tail -50 "$OUT/configure.log"; exit 1; }
cmake --build build -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -60; exit 1; }
echo "build ok"
case "$what" in
  test)
    (cd build && ctest --output-on-failure -j 4 ${2:+-R "$2"}) > "$OUT/test.log" 2>&1
    rc=$?
    tail -60 "$OUT/test.log"
    exit $rc ;;
  bench)
    bash bench/run.sh build 2>&1 | tee "$OUT/bench.log" ;;
  *) shift; "$@" ;;
esac
