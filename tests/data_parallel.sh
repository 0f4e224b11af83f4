#!/usr/bin/env bash
# tests/data_parallel.sh [TRAIN] [cpu|cuda]: data parallel as several ./train processes, the
# checks of tools/dp-check.sh as ctest tests: `dp_cpu` (every build, CI: train.procs, the
# average over TCP, trainer/comm_tcp.cpp) and `dp_gpu` (CUDA builds: train.gpus=2, NCCL, in
# f32 with LOOM_DETERMINISTIC=1; skipped, exit 4, on a machine with fewer than 2 GPUs).
#   equal   2 processes x batch B give the per-step losses of 1 process x 2B: MIM and the VLM
#           (f32, within tests/tolerances.h's kDataParallelLossF32)
#   buckets gradients averaged in small buckets during the backward (train.dist_bucket_mb),
#           in the default 25 MB ones and after the backward give the same losses (bit for
#           bit on the CPU, whose sums are in rank order), and small buckets do start before
#           the backward ends
#   zero    ZeRO-1 (train.zero_stage = 1) gives the losses of the unsharded run (on the CPU its
#           checkpoint files bit for bit); the fault test's resumes go unsharded -> sharded -> 1 process
#   infonce the contrastive MIM with train.dist_infonce = global: 2 x B as 1 x 2B; with local,
#           not (each rank's own negatives)
#   env     ranks started by hand with torchrun's variables (no launcher) give the same losses
#   hosts   (CPU) four such ranks, two of them joining through this machine's network address as
#           ranks on other machines would, give the launcher's losses
#   config  a rank started with another train.lr stops every rank at the rendezvous, naming the key
#   resume  a rank that finds no checkpoint where rank 0 resumes stops both before the first step
#   init    a rank that loads other init weights (model.lm_init) stops both before the first step
#   logs    the launcher started the ranks and rank 1 says how it averages
#   fault   kill -9 of rank 1: rank 0 and the launcher stop within 30 s with an error naming
#           the lost rank; the run resumes from its last checkpoint on 2 processes and on 1
# Prints one line per check and the number of failures; exits with 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
TRAIN=${1:-./train}
DEVICE=${2:-cpu}
if [ "$DEVICE" = cuda ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$gpus" -ge 2 ] || { echo "data_parallel cuda: $gpus GPU(s) here, 2 needed: skipped"; exit 4; }
  export LOOM_DETERMINISTIC=1 NCCL_NVLS_ENABLE=0
  RANKS=--train.gpus=2 DEV=(--train.device=cuda --train.dtype=f32) BACKEND="; NCCL"
else
  RANKS=--train.procs=2 DEV=(--train.device=cpu) BACKEND="CPU, gradients averaged over TCP"
fi
TOL=$(sed -n 's/^inline constexpr double kDataParallelLossF32 = \([0-9.e+-]*\);.*/\1/p' tests/tolerances.h)
[ -n "$TOL" ] || { echo "data_parallel: no kDataParallelLossF32 in tests/tolerances.h"; exit 1; }
W=$(mktemp -d /tmp/loom_data_parallel_XXXXXX)
trap 'rm -rf "$W"' EXIT
fails=0
note() { echo "data_parallel $DEVICE: $*"; }
fail() { note "FAIL: $*"; fails=$((fails + 1)); }

# losses FILE: "step loss" per training line of metrics.jsonl
losses() { sed -n 's/.*"kind":"train","loss":\([^,]*\),.*"step":\([0-9]*\)[,}].*/\2 \1/p' "$1"; }
# diff_of A B: prints "n of m steps, largest relative difference ..."; true when every step of
# A is in B within TOL
diff_of() {
  join <(losses "$1/metrics.jsonl" | sort -k1,1) <(losses "$2/metrics.jsonl" | sort -k1,1) |
        awk -v tol=$TOL -v want="$(losses "$1/metrics.jsonl" | wc -l)" '
          { d = $2 - $3; if (d < 0) d = -d; s = $2 < 0 ? -$2 : $2; r = d / (s > 1e-12 ? s : 1e-12);
            if (r > worst) { worst = r; at = $1 } n++ }
          END { printf "%d of %d steps, largest relative difference %.3e (step %s)", n, want, worst, at;
                exit !(n == want && n > 0 && worst <= tol) }'
}
# compare NAME A B: every step of A in B, relative loss difference <= TOL
compare() {
  local out
  out=$(diff_of "$2" "$3")
  if [ $? -eq 0 ]; then note "$1: $out: ok"; else fail "$1: $out (tolerance $TOL)"; fi
}
run() {  # run NAME ARGS...: ./train with a time limit, its log in $W/NAME.log
  local name=$1
  shift
  timeout 300 "$TRAIN" "$@" > "$W/$name.log" 2>&1 || { fail "$name: exit $?"; tail -5 "$W/$name.log"; return 1; }
}

# Fashion-MNIST: the copy tools/gpu-prep.sh bundles into .deps where there is one (a machine
# without the Debian package), else the package's (the trainer's default)
MIMDATA=()
[ -d .deps/fashion-mnist ] && MIMDATA=(--data.path=.deps/fashion-mnist)
MIM=(vit_mim.cfg "${DEV[@]}" "${MIMDATA[@]}" --train.steps=8 --train.warmup_steps=2 --train.log_every=1 --train.eval_every=0
     --data.train_samples=512 --data.val_samples=64 --eval.samples=64)
VLM=(vlm_sft.cfg "${DEV[@]}" --train.steps=8 --train.warmup_steps=2 --train.log_every=1 --train.eval_every=0
     --data.train_samples=200 --data.val_samples=8 --eval.samples=4)

# ---- equal
run mim_1 "${MIM[@]}" --train.batch_size=32 --train.out_dir="$W/mim_1" &&
  run mim_2 "${MIM[@]}" --train.batch_size=16 $RANKS --train.out_dir="$W/mim_2" &&
  compare "mim, 1 process x 32 vs 2 processes x 16" "$W/mim_1" "$W/mim_2"
run vlm_1 "${VLM[@]}" --train.batch_size=4 --train.out_dir="$W/vlm_1" &&
  run vlm_2 "${VLM[@]}" --train.batch_size=2 $RANKS --train.out_dir="$W/vlm_2" &&
  compare "vlm_sft, 1 process x 4 rows vs 2 processes x 2 rows" "$W/vlm_1" "$W/vlm_2"

# ---- buckets: the averages of small buckets start during the backward; the sums are the same
run mim_2_b0 "${MIM[@]}" --train.batch_size=16 $RANKS --train.dist_bucket_mb=0 --train.out_dir="$W/mim_2_b0" &&
  run mim_2_bs "${MIM[@]}" --train.batch_size=16 $RANKS --train.dist_bucket_mb=0.02 --train.out_dir="$W/mim_2_bs" &&
  if [ "$DEVICE" = cpu ]; then
    if cmp -s <(losses "$W/mim_2_b0/metrics.jsonl") <(losses "$W/mim_2_bs/metrics.jsonl") &&
       cmp -s <(losses "$W/mim_2_b0/metrics.jsonl") <(losses "$W/mim_2/metrics.jsonl"); then
      note "mim, 2 processes: buckets of 0.02 MB, of 25 MB and one average after the backward give the same losses bit for bit: ok"
    else
      fail "mim, 2 processes: the losses differ between train.dist_bucket_mb = 0, 0.02 and 25"
    fi
  else  # NCCL may pick another algorithm for another message size
    compare "mim, 2 GPUs: one average after the backward vs buckets of 0.02 MB" "$W/mim_2_b0" "$W/mim_2_bs"
    compare "mim, 2 GPUs: one average after the backward vs buckets of 25 MB" "$W/mim_2_b0" "$W/mim_2"
  fi
early=$(sed -n 's/^data parallel: \([0-9]*\) gradient buckets, \([0-9]*\) of them averaged while the backward ran$/\1 \2/p' "$W/mim_2_bs.log")
if [ -n "$early" ] && [ "${early% *}" -gt 2 ] && [ "${early#* }" -gt 1 ]; then
  note "buckets of 0.02 MB: ${early#* } of ${early% *} averaged while the backward ran: ok"
else
  fail "buckets of 0.02 MB: expected several buckets, more than one averaged during the backward; the log says '$early'"
fi

# ---- ZeRO-1 (train.zero_stage = 1): each rank updates its part of the weights from the moments it
# holds, then the parts are gathered; the same losses and, on the CPU, the same checkpoint bytes
# (the moments gathered into the single-process layout)
same_run() {  # same_run NAME A B: bit for bit on the CPU (losses and last checkpoint), within TOL on GPUs
  if [ "$DEVICE" != cpu ]; then compare "$1" "$2" "$3"; return; fi
  local ck
  ck=$(ls "$2" | grep '^step_' | sort | tail -1)
  if cmp -s <(losses "$2/metrics.jsonl") <(losses "$3/metrics.jsonl") && [ -n "$ck" ] &&
     cmp -s "$2/$ck/optimizer.safetensors" "$3/$ck/optimizer.safetensors" &&
     cmp -s "$2/$ck/model.safetensors" "$3/$ck/model.safetensors"; then
    note "$1: the same losses and $ck files bit for bit: ok"
  else
    fail "$1: the losses or the $ck files differ"
  fi
}
run mim_2z "${MIM[@]}" --train.batch_size=16 $RANKS --train.zero_stage=1 --train.out_dir="$W/mim_2z" &&
  same_run "mim, 2 processes, ZeRO-1 vs not" "$W/mim_2" "$W/mim_2z"
run vlm_2z "${VLM[@]}" --train.batch_size=2 $RANKS --train.zero_stage=1 --train.out_dir="$W/vlm_2z" &&
  same_run "vlm_sft, 2 processes, ZeRO-1 vs not" "$W/vlm_2" "$W/vlm_2z"
if grep -q "^optimizer .*ZeRO-1, rank 1 of 2: moments of" "$W/vlm_2z/rank_1.log" 2>/dev/null; then
  note "ZeRO-1: rank 1 says $(sed -n 's/^optimizer .*ZeRO-1, rank 1 of 2: \(.*\)$/\1/p' "$W/vlm_2z/rank_1.log"): ok"
else
  fail "ZeRO-1: rank 1's log has no 'ZeRO-1, rank 1 of 2' optimizer line"
fi

# ---- the contrastive MIM's InfoNCE: with train.dist_infonce = global (the pooled features of
# every rank gathered) 2 x 16 trains as 1 x 32; with the default (local: each rank's own batch as
# negatives, as the reference's DDP) it does not, which shows the comparison can fail
run cmim_1 "${MIM[@]}" --model.contrastive=true --train.batch_size=32 --train.out_dir="$W/cmim_1" &&
  run cmim_2g "${MIM[@]}" --model.contrastive=true --train.batch_size=16 $RANKS --train.dist_infonce=global \
    --train.out_dir="$W/cmim_2g" &&
  compare "contrastive mim, global InfoNCE, 1 process x 32 vs 2 processes x 16" "$W/cmim_1" "$W/cmim_2g" &&
  run cmim_2l "${MIM[@]}" --model.contrastive=true --train.batch_size=16 $RANKS --train.out_dir="$W/cmim_2l" &&
  if out=$(diff_of "$W/cmim_1" "$W/cmim_2l"); then
    fail "contrastive mim, local InfoNCE: 2 x 16 matched 1 x 32 ($out); expected each rank's own negatives to show"
  else
    note "contrastive mim, local InfoNCE: 2 x 16 differs from 1 x 32 ($out): ok"
  fi

# ---- torchrun's way: two processes started with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
# no launcher of ours give the launcher's losses (on the CPU bit for bit: each rank with the
# threads the launcher gives it, the summation orders are the same). Rank 1 names its device or
# dtype as `auto`, which resolves to rank 0's: the ranks compare resolved values, so that passes
P=$((20000 + RANDOM % 20000))
threads=${OMP_NUM_THREADS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
if [ "$DEVICE" = cuda ]; then same=(--train.device=auto); else same=(--train.dtype=f32); fi
for k in 0 1; do
  extra=()
  [ $k -eq 1 ] && extra=("${same[@]}")
  RANK=$k LOCAL_RANK=$k WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$P OMP_NUM_THREADS=$threads \
    timeout 300 "$TRAIN" "${MIM[@]}" --train.batch_size=16 "${extra[@]}" --train.out_dir="$W/mim_env" \
    > "$W/mim_env_$k.log" 2>&1 &
done
if wait -n && wait -n; then
  if [ "$DEVICE" = cpu ]; then
    if cmp -s <(losses "$W/mim_2/metrics.jsonl") <(losses "$W/mim_env/metrics.jsonl"); then
      note "mim, 2 ranks from environment variables and from ./train's launcher: the same losses bit for bit: ok"
    else
      fail "mim, 2 ranks from environment variables: losses differ from the launcher's run"
    fi
  else
    compare "mim, 2 ranks from environment variables vs ./train's launcher" "$W/mim_2" "$W/mim_env"
  fi
else
  fail "mim, 2 ranks from environment variables: a rank failed ($(grep -h '^error' "$W"/mim_env_*.log | head -1))"
fi

# ---- ranks as on several machines (CPU): four ranks from environment variables, ranks 1 and 3
# reaching rank 0 through this machine's network address (as ranks on other machines do: rank 0
# hands the others the address each of them came from) and rank 2 through 127.0.0.1 (a rank on
# rank 0's machine: reached at the address each rank reached rank 0 at). So rank 2 connects to
# rank 1 at its network address, and rank 3 to rank 2 at rank 0's. The losses must be those of
# ./train's launcher with 4 processes, bit for bit (each rank with the threads the launcher gives
# it: the products' sums depend on the thread count, kernels/cpu/matmul.cpp).
# Skipped where this machine has no IPv4 address other than a loopback one.
if [ "$DEVICE" = cpu ]; then
  host=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+(\.[0-9]+){3}$' | grep -v '^127\.' | head -1)
  if [ -z "$host" ]; then
    note "ranks as on several machines: no IPv4 address but a loopback one here: skipped"
  else
    run mim_4 "${MIM[@]}" --train.batch_size=8 --train.procs=4 --train.out_dir="$W/mim_4"
    P=$((20000 + RANDOM % 20000))
    threads4=${OMP_NUM_THREADS:-$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))}
    for k in 0 1 2 3; do
      addr=127.0.0.1
      [ $((k % 2)) -eq 1 ] && addr=$host
      RANK=$k LOCAL_RANK=$k WORLD_SIZE=4 LOCAL_WORLD_SIZE=4 MASTER_ADDR=$addr MASTER_PORT=$P OMP_NUM_THREADS=$threads4 \
        timeout 300 "$TRAIN" "${MIM[@]}" --train.batch_size=8 --train.out_dir="$W/mim_hosts" \
        > "$W/mim_hosts_$k.log" 2>&1 &
    done
    ok=1
    for k in 0 1 2 3; do wait -n || ok=0; done
    if [ $ok -eq 1 ] && [ -s "$W/mim_4/metrics.jsonl" ] &&
       cmp -s <(losses "$W/mim_4/metrics.jsonl") <(losses "$W/mim_hosts/metrics.jsonl"); then
      note "mim, 4 ranks, 1 and 3 through $host and 0 and 2 through 127.0.0.1: the launcher's losses bit for bit: ok"
    else
      fail "mim, 4 ranks through $host and 127.0.0.1: a rank failed or the losses differ from the launcher's ($(grep -h '^error' "$W"/mim_hosts_*.log | head -1))"
    fi
  fi
fi

# mismatch NAME WHAT TEXT: two ranks from environment variables, rank 0 with the arguments in R0
# and rank 1 with those in R1; both must stop before training (an error exit, not the time limit)
# and both logs must say TEXT
mismatch() {
  local name=$1 what=$2 text=$3 P=$((20000 + RANDOM % 20000)) k rc_a rc_b msg
  local -a args
  for k in 0 1; do
    if [ $k -eq 0 ]; then args=("${R0[@]}"); else args=("${R1[@]}"); fi
    RANK=$k LOCAL_RANK=$k WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$P OMP_NUM_THREADS=1 \
      timeout 60 "$TRAIN" "${args[@]}" > "$W/${name}_$k.log" 2>&1 &
  done
  wait -n; rc_a=$?
  wait -n; rc_b=$?
  msg=$(grep -h -- "$text" "$W/${name}_1.log" | head -1)
  if [ $rc_a -ne 0 ] && [ $rc_b -ne 0 ] && [ $rc_a -ne 124 ] && [ $rc_b -ne 124 ] && [ -n "$msg" ] &&
     grep -q -- "$text" "$W/${name}_0.log"; then
    note "$what: both stop before training, naming it: ok"
  else
    fail "$what: exits $rc_a / $rc_b, rank 1 says '$msg'"
  fi
}

# ---- a rank started with other overrides (a torchrun node given another learning rate) is
# refused at the rendezvous, with the key named, instead of training another model silently
R0=("${MIM[@]}" --train.batch_size=16 --train.out_dir="$W/mim_cfg")
R1=("${R0[@]}" --train.lr=0.123)
mismatch mim_cfg "a rank with another train.lr" "train.lr = 0.123"

# ---- a rank that does not see the checkpoint (node-local out_dirs) would start from step 0 beside
# rank 0's resumed weights
cp -r "$W/mim_2" "$W/mim_seen"
R0=("${MIM[@]}" --train.batch_size=16 --train.steps=12 --train.resume=latest --train.out_dir="$W/mim_seen")
R1=("${MIM[@]}" --train.batch_size=16 --train.steps=12 --train.resume=latest --train.out_dir="$W/mim_unseen")
mismatch mim_resume "a rank without the checkpoint" "the step the run starts from differs"

# ---- a rank whose init file differs (model.lm_init is a path, which the config comparison
# leaves out: node-local copies) would train from other weights
R0=("${VLM[@]}" --train.batch_size=2 --train.out_dir="$W/vlm_init_0")
R1=("${VLM[@]}" --train.batch_size=2 --model.lm_init="$W/vlm_1" --train.out_dir="$W/vlm_init_1")
mismatch vlm_init "a rank with other init weights" "the weights the run starts from differs"

# ---- logs
if [ -f "$W/vlm_2/rank_1.log" ] && grep -q "^data parallel: rank 1 of 2.*$BACKEND" "$W/vlm_2/rank_1.log" &&
   grep -q "^launching 2 ranks" "$W/vlm_2.log"; then
  note "logs: the launcher started 2 ranks, rank 1 says '$BACKEND': ok"
else
  fail "logs: no data-parallel lines with '$BACKEND' in $W/vlm_2.log / rank_1.log"
fi

# ---- fault
D="$W/fault"
F=("${MIM[@]}" --train.steps=4000 --train.batch_size=16 --train.save_every=5 --train.keep_last=2 --train.out_dir="$D")
"$TRAIN" "${F[@]}" $RANKS > "$W/fault.log" 2>&1 &
launcher=$!
for _ in $(seq 1 600); do
  ls "$D" 2>/dev/null | grep -q '^step_0*[1-9][0-9]*$' && break
  sleep 0.1
done
rank1=$(pgrep -P $launcher | while read -r p; do
          tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=1 && echo $p; done | head -1)
if [ -z "$rank1" ]; then
  fail "fault: no checkpoint or no rank 1 process within 60 s"
  kill $launcher 2>/dev/null
  wait $launcher 2>/dev/null
else
  t0=$(date +%s)
  kill -9 "$rank1"
  for _ in $(seq 1 300); do kill -0 $launcher 2>/dev/null || break; sleep 0.1; done
  if kill -0 $launcher 2>/dev/null; then
    fail "fault: the launcher still runs 30 s after rank 1 was killed"
    pkill -9 -P $launcher
    kill -9 $launcher
    wait $launcher 2>/dev/null
  else
    wait $launcher
    rc=$?
    msg=$(grep -hE "^(error|launcher)" "$W/fault.log" | grep "rank 1" | head -1)
    if [ $rc -ne 0 ] && echo "$msg" | grep -q "rank 1"; then
      note "fault: kill -9 of rank 1 -> exit $rc after $(( $(date +%s) - t0 )) s: $msg: ok"
    else
      fail "fault: exit $rc, error line '$msg'"
    fi
  fi
  last=$(ls "$D" | grep '^step_0*[0-9]*$' | sort | tail -1)
  stop=$(( 10#${last#step_} + 3 ))
  # the resume shards the optimizer (ZeRO-1) that the killed run did not, and the 1-process
  # resume then reads the sharded run's checkpoint
  run fault_resume_2 "${F[@]}" $RANKS --train.zero_stage=1 --train.resume=latest --train.stop_at=$stop &&
    grep -q "resumed from" "$W/fault_resume_2.log" && note "fault: resumed from $last on 2 processes with ZeRO-1, stopped at step $stop: ok" ||
    fail "fault: no resume on 2 processes (see $W/fault_resume_2.log)"
  run fault_resume_1 "${F[@]}" --train.batch_size=32 --train.resume=latest --train.stop_at=$((stop + 3)) &&
    grep -q "resumed from" "$W/fault_resume_1.log" && note "fault: the 2-process ZeRO-1 checkpoint resumed on 1 process: ok" ||
    fail "fault: no resume on 1 process"
fi
note "failures: $fails"
# 1 on any failure: ctest reads 4 as "skipped" for dp_gpu (fewer than 2 GPUs), so the count of
# failures is not the exit code
[ $fails -eq 0 ]
