#!/usr/bin/env bash
# check_hf_export.sh [BUILD_DIR] [DEVICE]: the export to Hugging Face checked end to end against
# transformers, in one command from the repository root (needs python3 with torch and
# transformers, and a built ./BUILD_DIR/train; default BUILD_DIR=build, DEVICE=auto):
#
#   1. trains a tiny VLM for 40 steps (configs/vlm_sft.cfg cut down; DEVICE = auto|cpu|cuda),
#   2. ./train eval on the run (the accuracy table again, from the checkpoint),
#   3. ./train export RUN --hf DIR,
#   4. tools/check_hf_export.py: transformers loads DIR (model, tokenizer, chat template) and
#      DIR/vision, and writes fixtures in the format of tests/fixtures/llama_tiny_s0 and
#      siglip_tiny_s0 from its own float64 forward and backward,
#   5. ./train tokenize on the chat text rendered by HF's template: the same ids as HF's,
#   6. ./train check on both fixtures on the CPU, and on CUDA when nvidia-smi sees a GPU and
#      the binary has CUDA (CHECK_CUDA=0 skips it, CHECK_CUDA=1 requires it).
#
# Tolerances (./train check, relative error ||loom - HF|| / ||HF|| of logits, loss and every
# gradient): on the CPU loom runs in float64 from the same float32 weights as transformers'
# float64 copy, so only summation order differs, except that HF computes its RoPE tables in
# float32: 1e-6 (llama_tiny_s0 shows ~2e-7). On CUDA loom computes in float32 (f32 weights, f32
# compute with f32 accumulation, ~1e-7 per operation compounded over the layers): 1e-4.
# The max abs logit difference is printed from the check's "max abs" column.
# Exits non-zero on any mismatch; the work folder is kept on failure.
set -euo pipefail
BUILD=${1:-build}
DEVICE=${2:-auto}
TRAIN="$BUILD/train"
[ -x "$TRAIN" ] || { echo "check_hf_export: $TRAIN not found (build first: make)" >&2; exit 2; }
python3 -c "import torch, transformers" || { echo "check_hf_export: python3 needs torch and transformers" >&2; exit 2; }
W=$(mktemp -d /tmp/loom_hf_export.XXXXXX)
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "check_hf_export: FAILED (rc $rc); files kept in $W" >&2; else rm -rf "$W"; fi' EXIT
step() { echo; echo "== $*"; }

step "1. a tiny VLM run ($DEVICE)"
"$TRAIN" vlm_sft.cfg --train.out_dir="$W/run" --train.device="$DEVICE" --train.steps=40 --train.warmup_steps=5 \
  --data.train_samples=600 --data.val_samples=32 --eval.samples=32 --train.eval_every=0 --train.log_every=10 \
  > "$W/train.log" 2>&1 || { tail -30 "$W/train.log"; exit 1; }
grep -A8 "^eval at step 40" "$W/train.log" || true

step "2. ./train eval (the same table from the checkpoint)"
"$TRAIN" eval "$W/run" --train.device="$DEVICE" | tee "$W/eval.log" | tail -8
# the same table as the run's end (bit-identical on the CPU; on a GPU reported, not required)
if diff <(grep -A7 "^eval at step 40" "$W/train.log" | grep -v "^wrote") <(grep -A7 "^eval at step 40" "$W/eval.log") > /dev/null; then
  echo "eval: the same table as at the end of training"
else
  echo "eval: the table differs from the one at the end of training"
fi

step "3. ./train export"
"$TRAIN" export "$W/run" --hf "$W/hf"
ls -la "$W/hf" "$W/hf/vision"

step "4. transformers loads the export"
python3 tools/check_hf_export.py "$W/hf" "$W/fixture"

step "5. loom's tokenizer on HF's rendered chat text"
"$TRAIN" tokenize --tokenizer "$W/hf/tokenizer.json" < "$W/fixture/chat.txt" > "$W/loom_ids.json"
python3 - "$W/loom_ids.json" "$W/fixture/chat_ids.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
print(f"loom {len(a)} ids, transformers {len(b)} ids: {'same' if a == b else 'DIFFERENT'}")
sys.exit(0 if a == b else 1)
PY

check() {  # FIXTURE DEVICE
  step "6. ./train check $1 --device $2"
  "$TRAIN" check "$1" --device "$2" | tee "$W/check.log" | grep -v "^grad " || true
  grep -q ": PASS$" "$W/check.log" || { cat "$W/check.log"; exit 1; }
  awk '$1 == "logits" || $1 == "last_hidden_state" {print "max abs " $1 " difference (loom vs transformers): " $4}' "$W/check.log"
}
check "$W/fixture/llama" cpu
check "$W/fixture/vision" cpu
cuda=${CHECK_CUDA:-auto}
if [ "$cuda" = auto ]; then
  cuda=0
  if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then cuda=1; fi
fi
if [ "$cuda" = 1 ]; then
  check "$W/fixture/llama" cuda
  check "$W/fixture/vision" cuda
else
  echo "(no GPU: CUDA check skipped)"
fi
echo
echo "check_hf_export: PASS"
