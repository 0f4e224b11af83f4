#!/usr/bin/env bash
# Build and run kernel-level GPU tests on a CUDA machine without the rest of the tree (a few
# minutes less than the full build): compiles kernels/cpu/*.cpp, kernels/cuda/*.cu and the named
# test files (each linked with the Catch2 main) on JOBS cores (default: all), then runs each
# test. Needs Eigen and Catch2 (the system's, or .deps from tools/gpu-prep.sh); CUDA_ARCH
# (default 90) picks the target, NVCC the compiler.
#   bash tools/gpu-kernels.sh tests/cuda/test_cuda_norms.cpp [more tests] [-- extra sources]
# A file under bench/ is linked with its own main (no Catch2) and run the same way.
# Logs: $OUT/kbuild.log and $OUT/<test>.log
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
B=/tmp/kbuild; mkdir -p $B
NVCC=${NVCC:-nvcc}
ARCH=${CUDA_ARCH:-90}
INC="-I. -I/usr/include/eigen3 -I.deps/include -I/usr/local/cuda/include"
DEF="-DLOOM_CUDA=1 -DPCRE2_CODE_UNIT_WIDTH=8"
GENCODE="-arch=sm_$ARCH"
if [ "$ARCH" = 90 ]; then GENCODE="-gencode=arch=compute_90a,code=sm_90a"; DEF="$DEF -DLOOM_SM90A=1"; fi
tests=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  tests+=("$1"); shift
done
objs=()
compile() {  # src -> obj
  local src=$1 obj=$B/$(echo "$1" | tr '/' '_').o
  case "$src" in
    *.cu) $NVCC -std=c++17 -O3 $GENCODE --expt-relaxed-constexpr -lineinfo $INC $DEF -c "$src" -o "$obj" ;;
    *) g++ -std=c++17 -O2 -pthread $INC $DEF -c "$src" -o "$obj" ;;
  esac
}
export -f compile; export B NVCC ARCH INC DEF GENCODE
srcs=(kernels/cpu/*.cpp kernels/cuda/*.cu tests/catch_main.cpp "${tests[@]}" "${extra[@]}")
printf '%s\n' "${srcs[@]}" | xargs -P "${JOBS:-$(nproc)}" -I{} bash -c 'compile {} || echo "FAILED {}"' > "$OUT/kbuild.log" 2>&1
if grep -q FAILED "$OUT/kbuild.log"; then grep -E "error|FAILED" "$OUT/kbuild.log" | head -80; exit 1; fi
lib=()
for s in kernels/cpu/*.cpp kernels/cuda/*.cu "${extra[@]}"; do lib+=($B/$(echo "$s" | tr '/' '_').o); done
rc=0
for t in "${tests[@]}"; do
  name=$(basename "$t" .cpp)
  main=$B/tests_catch_main.cpp.o; case "$t" in bench/*) main= ;; esac
  g++ -pthread -o $B/$name $B/$(echo "$t" | tr '/' '_').o $main "${lib[@]}" \
    -L/usr/local/cuda/lib64 -lcudart -lcublasLt -lcublas -lpthread >> "$OUT/kbuild.log" 2>&1 || { echo "link failed: $name"; tail -30 "$OUT/kbuild.log"; rc=1; continue; }
  echo "== $name"
  $B/$name ${TEST_ARGS:-} > "$OUT/$name.log" 2>&1; r=$?
  tail -25 "$OUT/$name.log"
  [ $r -ne 0 ] && rc=1
done
exit $rc
