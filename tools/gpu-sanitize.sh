#!/usr/bin/env bash
# The GPU test suite under NVIDIA compute-sanitizer, and one training step of each trainer
# under memcheck (issue 11). Needs the GPU machine and a CUDA build in build/ (tools/gpu-ci.sh
# build makes it). Every run uses --error-exitcode, so an error is a nonzero rc in the summary.
#   bash tools/gpu-sanitize.sh [tools...]   tools: memcheck racecheck initcheck synccheck train
#                                           (default: all)
#   SANITIZE_TIMEOUT=s per run (900), SANITIZE_TESTS='build/cuda_test_x ...' (all)
# Logs are written to a scratch folder and come back as $OUT/gpu-sanitize.tgz plus
# $OUT/sanitize-summary.txt (one line per test binary and tool: rc and compute-sanitizer's
# "ERROR SUMMARY"), also printed at the end.
# Limits and choices:
# - The caching allocator (kernels/cuda/allocator.cu) hands out pieces of larger cudaMalloc
#   blocks, so memcheck sees an overrun only when it leaves its block. It also keeps its
#   blocks until the process exits (as PyTorch's does), and so do the cuBLASLt and cuDNN
#   workspaces and plan caches: memcheck's leak report would list every one of them, so it
#   runs without --leak-check.
# - racecheck checks shared-memory hazards only; initcheck reports reads of device memory
#   never written.
# - cuDNN's own generated kernels are left out of racecheck, initcheck and synccheck
#   (--kernel-name-exclude kns=cudnn): synccheck reports a divergent barrier inside cuDNN
#   9.14's sm90 flash backward (cudnn_generated_fort_native_sdpa_sm90_flash_bprop_*), third-party
#   code this project cannot change; memcheck still checks them (their bounds come from our
#   descriptors).
set -uo pipefail
OUT=${OUT:-out}
W=$(mktemp -d)
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/.deps/lib:${LD_LIBRARY_PATH:-}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer 2>/dev/null | head -1)
log() { echo "$*" | tee -a "$W/summary.txt"; }
if [ -z "$CS" ]; then
  log "compute-sanitizer: not found in PATH or /usr/local/cuda (the CUDA toolkit's sanitizer package is missing)"
  tar czf "$OUT/gpu-sanitize.tgz" -C "$W" .; exit 2
fi
[ -x build/train ] || { log "no build/train: run tools/gpu-ci.sh build first"; exit 2; }
log "$("$CS" --version | tail -1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
tools=${*:-memcheck racecheck initcheck synccheck train}
TIMEOUT=${SANITIZE_TIMEOUT:-900}
status=0
for tool in $tools; do
  if [ "$tool" = train ]; then
    # one optimizer step of each trainer (dry_run: build, one forward + backward)
    for run in "vlm_sft.cfg --data.train_samples=200 --data.val_samples=8" \
               "vit_mim.cfg --data.dataset=synthetic --train.batch_size=16"; do
      name=train_$(echo "$run" | cut -d. -f1)
      timeout "$TIMEOUT" "$CS" --tool memcheck --error-exitcode 1 \
        ./build/train $run --train.dry_run=1 --train.out_dir="$W/$name" > "$W/$name.log" 2>&1
      rc=$?; [ $rc -ne 0 ] && status=1
      log "memcheck $name rc=$rc: $(grep -E 'ERROR SUMMARY' "$W/$name.log" | tail -1)"
    done
    continue
  fi
  for t in ${SANITIZE_TESTS:-build/cuda_test_*}; do
    [ -x "$t" ] || continue
    n=$(basename "$t")
    extra=""
    [ "$tool" != memcheck ] && extra="--kernel-name-exclude kns=cudnn"
    timeout "$TIMEOUT" "$CS" --tool "$tool" --error-exitcode 1 $extra "$t" > "$W/${tool}_$n.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    log "$tool $n rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$W/${tool}_$n.log" | tail -1) $(grep -E 'test cases' "$W/${tool}_$n.log" | tail -1)"
  done
done
rm -rf "$W"/train_*/step_* 2>/dev/null
tar czf "$OUT/gpu-sanitize.tgz" -C "$W" .
cp "$W/summary.txt" "$OUT/sanitize-summary.txt"
cat "$W/summary.txt"
exit $status
