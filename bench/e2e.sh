#!/usr/bin/env bash
# make bench-e2e: the SPEC §3 training steps, loom and the PyTorch reference (eager and
# torch.compile) on the same GPU in one call, then one table (bench/e2e_report.py): ms/step
# (median and p90 of the steps after warm-up), throughput, MFU, peak allocated and reserved
# memory, and the ratio to each PyTorch row.
#   bash bench/e2e.sh [BUILD_DIR]          writes $OUT (default bench/out)/e2e_*.jsonl, e2e_table.md
# E2E_STEPS (default 120) steps a loom row; the first E2E_WARMUP (default 70) are warm-up, the
# capture of the CUDA graph and the first seconds of load, left out of the table: the board's
# power cap pulls the clock down ~1 s into a load and settles it a little later, so the table's
# 50 steps are the steps a long run sees (with 30 and 5, the defaults before 2026-12-07, the
# medians were 1-1.5% faster and a contrastive p90 up to 1.11x its median: bench/RESULTS.md
# 2026-12-07). torch_ref.py's rows time the same steps (E2E_TORCH_WARMUP, default E2E_WARMUP, then
# E2E_TORCH_ITERS, default the rest of E2E_STEPS: its --warmup and --iters; it synchronizes after
# each timed step), so that both sides are timed in the same phase of the power cap; before
# 0970f97 (2026-12-07) it timed its own 5 + 20. E2E_TORCH=0 skips the reference.
# Energy per step of both sides, where the GPU has NVML's energy counter: loom's metrics.jsonl
# (energy_j at each logged step) and the reference's rows (J_per_step, W: it runs through
# tools/torch_ref_energy.py, which reads the counter around its timed loops); the report's
# energy table. Under the board's power limit a step's time follows its energy.
# E2E_ROWS (a comma list of loom's rows below, e.g. mim,mim_contrastive,mim_contrastive_shared,
# vlm_sft,vlm_sft_fixed,vlm_sft_ref; default all) and E2E_COMPILE (the reference's --compile list,
# default 0,1) run a part of the table when a call has less time.
# vlm_sft_ref trains the reference's own batch (its rows' sample lengths, written by
# tools/ref_vlm_rows.py where PyTorch and the reference are at hand): the same work as its row.
# The vlm_sft rows with a new batch at every step (vlm_sft, vlm_sft_ckpt) run twice as many steps
# and count the first half as warm-up: its image count meets new matmul shapes in its first ~30
# steps (kernels/cuda/matmul.cu, "Plans": such steps took up to 16 ms longer, and none came
# after step 29 of 60), which a fixed batch meets in its first step.
set -uo pipefail
B=${1:-build}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
STEPS=${E2E_STEPS:-120}
WARM=${E2E_WARMUP:-70}
case "$STEPS$WARM" in *[!0-9]*) echo "bench/e2e.sh: E2E_STEPS ($STEPS) and E2E_WARMUP ($WARM) must be counts"; exit 2 ;; esac
[ "$WARM" -lt "$STEPS" ] || { echo "bench/e2e.sh: E2E_WARMUP ($WARM) leaves none of E2E_STEPS ($STEPS) to time"; exit 2; }
TWARM=${E2E_TORCH_WARMUP:-$WARM}
TITERS=${E2E_TORCH_ITERS:-$((STEPS - WARM))}
case "$TWARM$TITERS" in *[!0-9]*) echo "bench/e2e.sh: E2E_TORCH_WARMUP ($TWARM) and E2E_TORCH_ITERS ($TITERS) must be counts"; exit 2 ;; esac
[ "$TITERS" -gt 0 ] || { echo "bench/e2e.sh: E2E_TORCH_ITERS must be at least 1"; exit 2; }
: > "$OUT/e2e_loom.jsonl"
ROWS=${E2E_ROWS:-all}
REF=../shared/reference/torch_ref.py
[ -f "$REF" ] || REF=.deps/shared/reference/torch_ref.py
HAVE_TORCH=
[ -f "$REF" ] && python3 -c "import torch" 2>/dev/null && HAVE_TORCH=1
# The GPU's SM clock, power, temperature and clock-event reasons every 200 ms (e2e_gpu.csv) and
# when each part began (e2e_parts.txt, the same clock): the report's last table says whether a part
# ran at a lower clock, and why, which moves its times without any change in the code. GPU 0 (or
# the first of CUDA_VISIBLE_DEVICES), the one the runs use.
: > "$OUT/e2e_parts.txt"
mark() { echo "$(date '+%Y/%m/%d %H:%M:%S.%3N'),$1" >> "$OUT/e2e_parts.txt"; }
SMI_PID=
if command -v nvidia-smi > /dev/null 2>&1; then
  V=${CUDA_VISIBLE_DEVICES:-0}
  # the board's power limit and highest SM clock, for the report's "at the limit" column
  nvidia-smi -i "${V%%,*}" --query-gpu=power.limit,clocks.max.sm --format=csv,noheader,nounits \
    > "$OUT/e2e_gpu_limits.txt" 2> /dev/null
  # and why the clock is below its highest, where the driver says (a bit mask: 0x4 the power cap,
  # 0x20 / 0x40 thermal, 0x8 / 0x80 hardware slowdown and power brake); older drivers call the
  # field clocks_throttle_reasons, and one without either samples the four columns alone
  Q=timestamp,clocks.sm,power.draw,temperature.gpu
  for r in clocks_event_reasons.active clocks_throttle_reasons.active; do
    if nvidia-smi -i "${V%%,*}" --query-gpu=$r --format=csv,noheader > /dev/null 2>&1; then Q=$Q,$r; break; fi
  done
  nvidia-smi -i "${V%%,*}" --query-gpu=$Q --format=csv,noheader,nounits \
    -lms 200 > "$OUT/e2e_gpu.csv" 2> /dev/null &
  SMI_PID=$!
fi
run() {  # name, steps, warm-up steps (not in the table), config, overrides...
  local name=$1 steps=$2 warm=$3 cfg=$4; shift 4
  case ",$ROWS," in ,all,|*",$name,"*) ;; *) return 0 ;; esac
  local dir="$OUT/e2e_$name"
  rm -rf "$dir"
  mark "loom $name"
  # the GPU's energy counter read after every step (trainer/step_log.cpp), for the energy table
  LOOM_ENERGY_READ_MS=0 timeout 400 "$B/train" "$cfg" --train.steps="$steps" --train.log_every=5 --train.out_dir="$dir" "$@" > "$OUT/e2e_$name.log" 2>&1
  local rc=$?
  mark end
  echo "loom $name rc=$rc: $(grep -E '^step +[0-9]+/' "$OUT/e2e_$name.log" | tail -1)"
  python3 - "$dir/metrics.jsonl" "$name" "$*" "$warm" >> "$OUT/e2e_loom.jsonl" <<'PY'
import json, sys
rows = [r for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()) if r.get("kind") == "train"]
print(json.dumps({"impl": "loom", "name": sys.argv[2], "args": sys.argv[3], "warmup": int(sys.argv[4]), "steps": rows}))
PY
  rm -rf "$dir"/step_*
}
run mim "$STEPS" "$WARM" bench_mim.cfg
run mim_loom_attention "$STEPS" "$WARM" bench_mim.cfg --train.attention=loom
run mim_eager "$STEPS" "$WARM" bench_mim.cfg --train.cuda_graph=false
run mim_ckpt "$STEPS" "$WARM" bench_mim.cfg --train.grad_checkpointing=true
run mim_contrastive "$STEPS" "$WARM" bench_mim.cfg --model.contrastive=true --train.keep_gelu=true  # (bench_mim.cfg says why)
# loom's contrastive trainer as it trains: two masked views of the same images, the EMA target's
# first blocks once for both (train.shared_target): less work than the reference's row, whose
# views are two images, so its ratios are printed in parentheses
run mim_contrastive_shared "$STEPS" "$WARM" bench_mim.cfg --model.contrastive=true --train.keep_gelu=true \
  --train.shared_target=true
run vlm_sft $((2 * STEPS)) "$STEPS" bench_vlm_sft.cfg
run vlm_sft_fixed "$STEPS" "$WARM" bench_vlm_sft.cfg --data.repeat_batch=true  # one batch every step, as the reference
run vlm_sft_ckpt $((2 * STEPS)) "$STEPS" bench_vlm_sft.cfg --train.grad_checkpointing=true  # new batches too
# the reference's own batch (its 8 rows' sample lengths, tools/ref_vlm_rows.py): the same work as its row
if [ -n "$HAVE_TORCH" ] && python3 tools/ref_vlm_rows.py --reference "$(dirname "$REF")" --out "$OUT/ref_rows.txt" \
     > "$OUT/ref_rows.log" 2>&1; then
  run vlm_sft_ref "$STEPS" "$WARM" bench_vlm_sft.cfg --data.repeat_batch=true --data.synth_rows="$OUT/ref_rows.txt"
else
  case ",$ROWS," in ,all,|*",vlm_sft_ref,"*) echo "vlm_sft_ref not run: $(tail -1 "$OUT/ref_rows.log" 2>/dev/null || echo 'no PyTorch here')" ;; esac
fi
rm -f "$OUT/torch_ref.jsonl"
if [ "${E2E_TORCH:-1}" = 1 ] && [ -n "$HAVE_TORCH" ]; then
  mark "torch_ref.py (every workload)"
  # through tools/torch_ref_energy.py: the reference's own main(), its timed loops' energy added to its rows
  timeout ${E2E_TORCH_TIMEOUT:-900} python3 tools/torch_ref_energy.py --reference "$(dirname "$REF")" bench --workload mim,mim_contrastive,vlm --compile "${E2E_COMPILE:-0,1}" --vlm-variants packed \
    --warmup "$TWARM" --iters "$TITERS" --out "$OUT" > "$OUT/e2e_torch.log" 2>&1
  rc=$?
  mark end
  # the steps its rows timed, for their labels in the table
  echo "{\"impl\": \"bench\", \"torch_warmup\": $TWARM, \"torch_iters\": $TITERS}" >> "$OUT/torch_ref.jsonl"
  if [ $rc = 124 ]; then
    echo "PyTorch reference stopped after ${E2E_TORCH_TIMEOUT:-900} s (E2E_TORCH_TIMEOUT): the table has the rows it finished"
  elif [ $rc != 0 ]; then
    tail -20 "$OUT/e2e_torch.log"
  fi
else
  echo "PyTorch reference not run"
fi
[ -n "$SMI_PID" ] && { kill "$SMI_PID" 2> /dev/null; wait "$SMI_PID" 2> /dev/null; }
python3 bench/e2e_report.py "$OUT/e2e_loom.jsonl" "$OUT/torch_ref.jsonl" | tee "$OUT/e2e_table.md"
