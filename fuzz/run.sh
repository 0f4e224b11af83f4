#!/usr/bin/env bash
# fuzz/run.sh [TARGET ...]: build the libFuzzer targets (clang, ASan + UBSan) in build-fuzz/,
# write the seed corpora (fuzz/make_seeds.cpp: from tests/fixtures and configs/), and run each
# target for FUZZ_SECONDS (default 60) on one core. Run from anywhere; `make fuzz` calls it.
#   build-fuzz/corpus/<target>/  the corpus, kept between runs (it grows)
#   build-fuzz/crashes/<target>/ what a failing input leaves (crash-*, leak-*, oom-*, timeout-*)
# A finding fails the script; fix it, then keep the input as tests/fuzz/<target>/<name>
# (tests/test_fuzz.cpp replays every file there in the normal test run).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${FUZZ_SECONDS:-60}
JOBS=${JOBS:-$(nproc)}
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(safetensors config jsonl tokenizer image idx rows)
B=build-fuzz
if [ ! -f $B/CMakeCache.txt ]; then
  CC=clang CXX=clang++ cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DLOOM_FUZZ=ON >/dev/null
else
  cmake -S . -B $B >/dev/null  # an existing build folder learns targets added to CMakeLists.txt
fi
cmake --build $B -j "$JOBS" --target make_seeds $(printf 'fuzz_%s ' "${TARGETS[@]}")
rm -rf $B/seeds && $B/make_seeds $B/seeds
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for t in "${TARGETS[@]}"; do
  mkdir -p $B/corpus/$t $B/crashes/$t
  log=$B/fuzz_$t.log
  # -rss_limit_mb / -malloc_limit_mb: a header that makes us allocate gigabytes is a finding
  kept=(); [ -d tests/fuzz/$t ] && kept=(tests/fuzz/$t)
  if $B/fuzz_$t $B/corpus/$t $B/seeds/$t "${kept[@]}" -max_total_time="$SECONDS_EACH" -timeout=10 \
       -rss_limit_mb=2048 -malloc_limit_mb=1024 -max_len=65536 -print_final_stats=1 \
       -artifact_prefix=$B/crashes/$t/ >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 || true)
    echo "fuzz $t: ${SECONDS_EACH}s, $runs executions, $cov, corpus $(ls $B/corpus/$t | wc -l) inputs, no finding"
  else
    status=1
    echo "fuzz $t: FINDING (log $log, input in $B/crashes/$t/):"
    grep -E 'ERROR|SUMMARY|property broken|==[0-9]+==' "$log" | head -8
  fi
done
exit $status
