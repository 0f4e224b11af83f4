#!/usr/bin/env bash
# The GPU test suite under NVIDIA compute-sanitizer, and one training step of each trainer
# under memcheck (issue 11). Needs the GPU machine and a CUDA build in build/ (tools/gpu-ci.sh
# build makes it). Every run uses --error-exitcode, so an error is a nonzero rc in the summary.
#   bash tools/gpu-sanitize.sh [tools...]   tools: memcheck racecheck initcheck synccheck train
#                                           (default: all)
# Logs go to $OUT/sanitize/ and come back as $OUT/gpu-sanitize.tgz; the summary (one line per
# test binary and tool: rc and compute-sanitizer's "ERROR SUMMARY") is printed at the end.
# Limits: the caching allocator (kernels/cuda/runtime.cu) hands out pieces of larger
# cudaMalloc blocks, so memcheck sees an overrun only when it leaves its block; racecheck
# checks shared-memory hazards only; initcheck reports reads of device memory never written.
set -uo pipefail
OUT=${OUT:-out}
W=$OUT/sanitize
mkdir -p "$W"
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
      timeout "$TIMEOUT" "$CS" --tool memcheck --error-exitcode 1 --leak-check full \
        ./build/train $run --train.dry_run=1 --train.out_dir="$W/$name" > "$W/$name.log" 2>&1
      rc=$?; [ $rc -ne 0 ] && status=1
      log "memcheck $name rc=$rc: $(grep -E 'ERROR SUMMARY' "$W/$name.log" | tail -1)"
    done
    continue
  fi
  for t in build/cuda_test_*; do
    [ -x "$t" ] || continue
    n=$(basename "$t")
    extra=""
    [ "$tool" = memcheck ] && extra="--leak-check full"
    [ "$tool" = initcheck ] && extra="--track-unused-memory no"
    timeout "$TIMEOUT" "$CS" --tool "$tool" --error-exitcode 1 $extra "$t" > "$W/${tool}_$n.log" 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    log "$tool $n rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$W/${tool}_$n.log" | tail -1) $(grep -E 'test cases' "$W/${tool}_$n.log" | tail -1)"
  done
done
rm -rf "$W"/train_*/step_* 2>/dev/null
tar czf "$OUT/gpu-sanitize.tgz" -C "$W" .
cat "$W/summary.txt"
exit $status
