#!/usr/bin/env bash
# make bench-ab: one binary, two settings, the SPEC §3 training steps alternated in one call, the
# way every "measured and kept / dropped" step comparison in bench/RESULTS.md is made. A setting
# is a list of environment assignments (the kernels' LOOM_* switches) and train overrides:
#   AB_A="LOOM_COLSUM=1 LOOM_FINISH_GROUPS=8" AB_B="" bash bench/ab.sh [BUILD_DIR]
#   AB_A="--train.keep_swiglu=false" AB_B="--train.keep_swiglu=true" AB_ROWS=vlm_sft_ref make bench-ab
# Words of a setting with a '=' and no leading "--" go to the environment, the rest to ./train.
# AB_ROWS: a comma list of mim, mim_contrastive, mim_contrastive_shared, vlm_sft_fixed, vlm_sft_ref (default mim,
# mim_contrastive,vlm_sft_ref; vlm_sft_ref needs PyTorch and the reference for its rows, or
# AB_REF_ROWS=FILE from tools/ref_vlm_rows.py). AB_ROUNDS (default 2) rounds, A then B in odd
# rounds and B then A in even ones, so that a drift in the machine (its clock at the power limit,
# bench/RESULTS.md 2026-12-02 second) does not favour one side; AB_STEPS (default 30) steps a run,
# the median over the steps after the first AB_WARMUP (default 5; with more steps, a larger one
# compares the steps after the board's power cap has settled the clock, ~1 s into a load). Logs
# and metrics go to $OUT (default bench/out/ab); the table, last, goes to $OUT/ab_table.md.
set -uo pipefail
B=${1:-build}
OUT=${OUT:-bench/out/ab}
mkdir -p "$OUT"
ROWS=${AB_ROWS:-mim,mim_contrastive,vlm_sft_ref}
ROUNDS=${AB_ROUNDS:-2}
STEPS=${AB_STEPS:-30}
WARM=${AB_WARMUP:-5}
case "$STEPS$WARM" in *[!0-9]*) echo "bench/ab.sh: AB_STEPS ($STEPS) and AB_WARMUP ($WARM) must be counts"; exit 2 ;; esac
[ "$WARM" -lt "$STEPS" ] || { echo "bench/ab.sh: AB_WARMUP ($WARM) leaves none of AB_STEPS ($STEPS) to time"; exit 2; }
A=${AB_A:-}
BS=${AB_B:-}
[ "$A" = "$BS" ] && { echo "bench/ab.sh: AB_A and AB_B are the same setting ('$A')"; exit 2; }
[ -x "$B/train" ] || { echo "bench/ab.sh: no $B/train (build first)"; exit 2; }

REFROWS=${AB_REF_ROWS:-}
case ",$ROWS," in
  *",vlm_sft_ref,"*)
    if [ -z "$REFROWS" ]; then
      REF=../shared/reference
      [ -d "$REF" ] || REF=.deps/shared/reference
      if python3 tools/ref_vlm_rows.py --reference "$REF" --out "$OUT/ref_rows.txt" > "$OUT/ref_rows.log" 2>&1; then
        REFROWS=$OUT/ref_rows.txt
      else
        echo "vlm_sft_ref not run: $(tail -1 "$OUT/ref_rows.log") (AB_REF_ROWS=FILE gives the rows)"
      fi
    fi ;;
esac

row_args() {  # a row's config and overrides
  case $1 in
    mim) echo "bench_mim.cfg" ;;
    mim_contrastive) echo "bench_mim.cfg --model.contrastive=true --train.keep_gelu=true" ;;
    mim_contrastive_shared) echo "bench_mim.cfg --model.contrastive=true --train.keep_gelu=true --train.shared_target=true" ;;
    vlm_sft_fixed) echo "bench_vlm_sft.cfg --data.repeat_batch=true" ;;
    vlm_sft_ref) if [ -n "$REFROWS" ]; then echo "bench_vlm_sft.cfg --data.repeat_batch=true --data.synth_rows=$REFROWS"; fi ;;
    *) echo "bench/ab.sh: unknown row '$1' (mim, mim_contrastive, mim_contrastive_shared, vlm_sft_fixed, vlm_sft_ref)" >&2; return 1 ;;
  esac
}

: > "$OUT/ab.jsonl"
one() {  # row, side (A or B), round
  local row=$1 side=$2 round=$3 setting line env=() args=() base=() w
  setting=$A; [ "$side" = B ] && setting=$BS
  line=$(row_args "$row") || exit 2
  [ -z "$line" ] && return 0  # vlm_sft_ref without its rows
  read -r -a base <<< "$line"
  for w in $setting; do
    case $w in --*) args+=("$w") ;; *=*) env+=("$w") ;; *) args+=("$w") ;; esac
  done
  local dir="$OUT/run_${row}_${side}_$round"
  rm -rf "$dir"
  # the energy counter read after every step (trainer/step_log.cpp; a setting may say otherwise)
  env LOOM_ENERGY_READ_MS=0 "${env[@]}" "$B/train" "${base[@]}" --train.steps="$STEPS" --train.log_every=1 --train.out_dir="$dir" \
    "${args[@]}" > "$dir.log" 2>&1
  local rc=$?
  python3 - "$dir/metrics.jsonl" "$row" "$side" "$round" "$rc" "$WARM" >> "$OUT/ab.jsonl" <<'PY'
import json, os, statistics, sys
path, row, side, rnd, rc, warm = sys.argv[1:]
steps = []
if os.path.exists(path):
    steps = [r for r in (json.loads(l) for l in open(path) if l.strip()) if r.get("kind") == "train"]
ms = [r["ms"] for r in steps if r["step"] > int(warm)]
out = {"row": row, "side": side, "round": int(rnd), "rc": int(rc), "steps": len(steps)}
if ms:
    out.update(median=statistics.median(ms), loss2=steps[1]["loss"] if len(steps) > 1 else None,
               peak_mb=steps[-1].get("mem_mb"))
    # J a step over the timed steps: the energy counter (energy_j where the trainer read it: every
    # step here, LOOM_ENERGY_READ_MS=0 above) moves about every 100 ms, so the mean power between
    # its first and last update inside them (tools/energy_counter.py), times the mean step
    seq = [r for r in steps if r["step"] >= int(warm)]
    if len(seq) > 2 and seq[0]["step"] == int(warm) and any(r.get("energy_j", -1) >= 0 for r in seq):
        sys.path.insert(0, "tools")
        from energy_counter import counter_power, step_reads
        got = counter_power(step_reads(seq))
        if got:
            out["j_step"] = got[0] * statistics.mean(ms) / 1e3
print(json.dumps(out))
PY
  rm -rf "$dir"/step_*
  tail -1 "$OUT/ab.jsonl"
}

IFS=, read -r -a rows <<< "$ROWS"
for row in "${rows[@]}"; do row_args "$row" > /dev/null || exit 2; done
for ((r = 1; r <= ROUNDS; r++)); do
  for row in "${rows[@]}"; do
    if ((r % 2)); then one "$row" A "$r"; one "$row" B "$r"; else one "$row" B "$r"; one "$row" A "$r"; fi
  done
done

python3 - "$OUT/ab.jsonl" "$A" "$BS" "$WARM" <<'PY' | tee "$OUT/ab_table.md"
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
a, b = sys.argv[2] or "(defaults)", sys.argv[3] or "(defaults)"
print(f"A: {a}\nB: {b}\n")
print("| row | A ms/step (per round) | B ms/step (per round) | B - A, mean | B / A | loss at step 2, A / B | peak MB, A / B "
      "| A J/step | B J/step |")
print("|---|---|---|---|---|---|---|---|---|")
for row in dict.fromkeys(r["row"] for r in runs):
    side = {s: sorted((r for r in runs if r["row"] == row and r["side"] == s), key=lambda r: r["round"]) for s in "AB"}
    ok = {s: [r for r in side[s] if "median" in r] for s in "AB"}
    cell = lambda s: " / ".join(f"{r['median']:.2f}" if "median" in r else f"failed (rc {r['rc']})" for r in side[s])
    if ok["A"] and ok["B"]:
        ma, mb = (statistics.mean(r["median"] for r in ok[s]) for s in "AB")
        diff, ratio = f"{mb - ma:+.2f} ms", f"{mb / ma:.3f}"
    else:
        diff = ratio = "—"
    loss = " / ".join(f"{ok[s][0]['loss2']:.6f}" if ok[s] and ok[s][0].get("loss2") is not None else "—" for s in "AB")
    peak = " / ".join(f"{ok[s][0]['peak_mb']:.0f}" if ok[s] and ok[s][0].get("peak_mb") else "—" for s in "AB")
    joules = lambda s: " / ".join(f"{r['j_step']:.2f}" if "j_step" in r else "—" for r in side[s])
    print(f"| {row} | {cell('A')} | {cell('B')} | {diff} | {ratio} | {loss} | {peak} | {joules('A')} | {joules('B')} |")
print(f"\nMedians of steps {int(sys.argv[4]) + 1} and on, one binary, alternated in one call: a difference smaller than the "
      "spread between one side's rounds is noise.")
PY
