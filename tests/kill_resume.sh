#!/usr/bin/env bash
# tests/kill_resume.sh [TRAIN] [KILLS]: kill anywhere, lose nothing (CPU, a few minutes).
#
# A tiny VLM run that checkpoints every step is started with --train.resume=latest, killed
# with SIGKILL at a random moment, restarted, killed again, ... at least KILLS times (default
# 20); half of the kills wait for a checkpoint folder step_N.tmp to appear and strike while
# it is being written. Then the run is let finish. It must end exactly like an
# uninterrupted run of the same config:
#   - metrics.jsonl: the same (step, loss) lines, bit for bit (the JSON text of each double),
#     and the same final evaluation, with every line whole;
#   - the final checkpoint's model.safetensors and optimizer.safetensors byte for byte;
#   - no resume may fail: a half-written checkpoint taken as the latest would fail to load
#     (or load different weights and break the comparison).
# Prints: kills, kills during a checkpoint write, resumes, steps compared.
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN=${1:-./train}
KILLS=${2:-20}
STEPS=${KILL_TEST_STEPS:-400}  # long enough that KILLS kills land before the end (80 was too few once a CPU step took 0.1 s)
W=$(mktemp -d /tmp/loom_kill_resume_XXXXXX)
trap 'rm -rf "$W"' EXIT
ARGS=(vlm_sft.cfg --train.device=cpu --data.train_samples=400 --data.val_samples=8 --train.batch_size=2
      --train.steps=$STEPS --train.warmup_steps=4 --train.eval_every=0 --eval.samples=4 --train.log_every=1
      --train.save_every=1 --train.keep_last=2 --data.workers=2 --train.seed=3)

echo "kill_resume: reference run ($STEPS steps, uninterrupted)"
"$TRAIN" "${ARGS[@]}" --train.out_dir="$W/ref" >"$W/ref.log" 2>&1 || { cat "$W/ref.log"; exit 1; }

run="$W/killed"
kills=0; ckpt_kills=0; resumes=0; attempt=0
ms() { date +%s%3N; }
while [ $kills -lt "$KILLS" ]; do
  attempt=$((attempt + 1))
  [ $attempt -le $((KILLS * 4)) ] || { echo "kill_resume: the run finished before $KILLS kills"; exit 1; }
  log="$W/run_$attempt.log"
  "$TRAIN" "${ARGS[@]}" --train.out_dir="$run" --train.resume=latest >"$log" 2>&1 &
  pid=$!
  if [ $((attempt % 2)) -eq 0 ]; then
    # wait (up to 10 s) for a checkpoint being written, then strike after 0-4 ms
    end=$(( $(ms) + 10000 ))
    while kill -0 $pid 2>/dev/null && [ "$(ms)" -lt $end ]; do
      if compgen -G "$run/step_*.tmp" >/dev/null; then sleep "0.00$((RANDOM % 5))"; break; fi
    done
  else
    sleep "0.$((RANDOM % 1000))"  # start-up, data, a step or a few: anywhere in the first second
  fi
  if kill -0 $pid 2>/dev/null; then
    kill -9 $pid 2>/dev/null || true
    wait $pid 2>/dev/null || true
    kills=$((kills + 1))
    compgen -G "$run/step_*.tmp" >/dev/null && ckpt_kills=$((ckpt_kills + 1))
  else
    wait $pid || { echo "kill_resume: run $attempt failed:"; tail -5 "$log"; exit 1; }
    echo "kill_resume: run $attempt finished after only $kills kills: raise KILL_TEST_STEPS"
    exit 1
  fi
  if grep -q "^error" "$log"; then echo "kill_resume: run $attempt failed:"; grep "^error" "$log"; exit 1; fi
  grep -q "^resumed from" "$log" && resumes=$((resumes + 1))
done
echo "kill_resume: final run to the end"
"$TRAIN" "${ARGS[@]}" --train.out_dir="$run" --train.resume=latest >"$W/final.log" 2>&1 || { tail -5 "$W/final.log"; exit 1; }
grep -q "^resumed from" "$W/final.log" && resumes=$((resumes + 1))

# compare: (kind, step, loss / val_loss / accuracy) of every line, as JSON text
extract() {
  # one line per metrics line: kind, step, loss or the eval values; a torn line fails here
  while IFS= read -r line; do
    case "$line" in
      \{*\}) ;;
      *) echo "TORN: $line"; continue ;;
    esac
    kind=$(sed -n 's/.*"kind":"\([a-z]*\)".*/\1/p' <<<"$line")
    step=$(sed -n 's/.*"step":\([0-9.e+]*\).*/\1/p' <<<"$line")
    case "$kind" in
      train) echo "train $step $(sed -n 's/.*"loss":\([^,}]*\).*/\1/p' <<<"$line")" ;;
      eval) echo "eval $step $(sed -n 's/.*"val_loss":\([^,}]*\).*/\1/p' <<<"$line") $(sed -n 's/.*"accuracy":\([^,}]*\).*/\1/p' <<<"$line")" ;;
      *) echo "$kind $step" ;;
    esac
  done <"$1"
}
extract "$W/ref/metrics.jsonl" >"$W/ref.txt"
extract "$run/metrics.jsonl" >"$W/run.txt"
steps=$(grep -c '^train ' "$W/ref.txt")
if ! diff "$W/ref.txt" "$W/run.txt" >"$W/diff.txt"; then
  echo "kill_resume: FAIL: metrics.jsonl differs from the uninterrupted run:"; head -20 "$W/diff.txt"; exit 1
fi
[ "$steps" -eq "$STEPS" ] || { echo "kill_resume: FAIL: $steps train lines, expected $STEPS"; exit 1; }
last=$(printf 'step_%08d' "$STEPS")
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$W/ref/$last/$f" "$run/$last/$f" || { echo "kill_resume: FAIL: $last/$f differs from the uninterrupted run"; exit 1; }
done
leftover=$(compgen -G "$run/step_*.*" || true)
[ -z "$leftover" ] || { echo "kill_resume: FAIL: leftovers $leftover"; exit 1; }
echo "kill_resume: passed: $kills kills ($ckpt_kills during a checkpoint write), $resumes resumes, $steps steps compared bit for bit, final weights and optimizer state identical"
