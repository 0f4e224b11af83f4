#!/usr/bin/env bash
# On a CUDA machine, after a CUDA build in build/: trace the SPEC §3 training steps with
# cupti_trace.cpp and print report.py's summary for each. Logs and traces go to $OUT.
#   bash tools/trace/run_trace.sh [CONFIG ...] [-- --train.key=value ...]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CUPTI_INC=$CUDA_HOME/include; CUPTI_LIB=$CUDA_HOME/lib64
[ -f $CUDA_HOME/extras/CUPTI/include/cupti.h ] && CUPTI_INC=$CUDA_HOME/extras/CUPTI/include CUPTI_LIB=$CUDA_HOME/extras/CUPTI/lib64
g++ -O2 -shared -fPIC tools/trace/cupti_trace.cpp -I"$CUPTI_INC" -I$CUDA_HOME/include -L"$CUPTI_LIB" -lcupti \
  -Wl,-rpath,"$CUPTI_LIB" -o build/libloom_trace.so || exit 1
cfgs=(); extra=()
while [ $# -gt 0 ]; do [ "$1" = "--" ] && { shift; extra=("$@"); break; }; cfgs+=("$1"); shift; done
[ ${#cfgs[@]} -eq 0 ] && cfgs=(bench_mim.cfg bench_vlm_sft.cfg)
for c in "${cfgs[@]}"; do
  n=$(basename "$c" .cfg)
  CUDA_INJECTION64_PATH=$PWD/build/libloom_trace.so LOOM_TRACE_FILE="$OUT/$n.csv" \
    timeout 300 ./build/train "$c" --train.out_dir="$OUT/run_$n" "${extra[@]}" > "$OUT/$n.log" 2>&1
  echo "== $n rc=$?"; grep -E "^step +(1[0-9]|2[0-5])/" "$OUT/$n.log" | tail -3
  python3 tools/trace/report.py "$OUT/$n.csv" --top 25 | tee "$OUT/$n.report.txt"
  gzip -f "$OUT/$n.csv"
done
