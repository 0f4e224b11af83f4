#!/usr/bin/env bash
# make bench: our kernel benchmarks and the PyTorch reference on the same GPU in one run, then
# the ratio table (bench/report.py). Needs a CUDA build and, for the reference, python3 with
# torch and ../shared/reference/torch_ref.py (or .deps/shared/reference where tools/gpu-prep.sh bundled it).
#   bash bench/run.sh BUILD_DIR          writes $OUT (default bench/out)/{loom,torch_ref}.jsonl
set -uo pipefail
B=${1:-build}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
: > "$OUT/loom.jsonl"
for b in bench_kernels_a bench_attention bench_losses; do
  if [ -x "$B/$b" ]; then "$B/$b" | tee -a "$OUT/loom.jsonl"; else echo "missing $B/$b (CUDA build?)"; fi
done
# SPEC §3's packed VLM batch through the LM's attention (ours and cuDNN; the reference has no such row)
[ -x "$B/bench_attention" ] && LOOM_BENCH_ATTN_PACKED=8,2048,9,3,64,1 "$B/bench_attention" | tee -a "$OUT/loom.jsonl"
REF=../shared/reference/torch_ref.py
[ -f "$REF" ] || REF=.deps/shared/reference/torch_ref.py
if [ -f "$REF" ] && python3 -c "import torch" 2>/dev/null; then
  rm -f "$OUT/torch_ref.jsonl"
  python3 "$REF" bench --workload kernels --out "$OUT" > "$OUT/torch_ref.log" 2>&1 || tail -20 "$OUT/torch_ref.log"
else
  echo "PyTorch reference not run (needs torch and $REF)"
fi
python3 bench/report.py "$OUT/loom.jsonl" "$OUT/torch_ref.jsonl" | tee "$OUT/table.md"
