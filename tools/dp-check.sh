#!/usr/bin/env bash
# Data parallel on a machine with >= 2 GPUs, from the repo root (after tools/gpu-prep.sh; NCCL
# from the CUDA toolkit, the system or .deps). Logs and metrics under $OUT (default out/).
#   bash tools/dp-check.sh build      configure + build ./train (CUDA, NCCL)
#   bash tools/dp-check.sh equal      f32: 2 GPUs x batch B == 1 GPU x 2B, per-step losses, MIM and VLM
#   bash tools/dp-check.sh bf16       the same in bf16 (tolerance BF16_TOL, default 2e-2)
#   bash tools/dp-check.sh scale      bench_mim / bench_vlm_sft, same per-GPU batch: 1 vs 2 GPUs, the 2-GPU
#                                     run with gradient buckets beside the backward (default) and
#                                     with one average after it (train.dist_bucket_mb=0)
#   bash tools/dp-check.sh zero       ZeRO-1 (train.zero_stage=1) on 2 GPUs against the unsharded run:
#                                     bench_mim / bench_vlm_sft, losses (f32, deterministic), step rate
#                                     and each run's peak memory
#   bash tools/dp-check.sh infonce    contrastive MIM, f32: 2 GPUs x 16 with train.dist_infonce=global
#                                     == 1 GPU x 32 (and with the default local InfoNCE: not)
#   bash tools/dp-check.sh nodes      two torchrun launchers (--nnodes=2, one GPU each) over sockets
#   bash tools/dp-check.sh fault      kill -9 of rank 1 mid-run; rank 0 must stop in < 60 s; resume
#   bash tools/dp-check.sh auto       vlm_sft.cfg as shipped (train.device = auto) on 2 GPUs, bf16 and
#                                     fp16, 60 steps: each rank on its own GPU (the ranks once all
#                                     took GPU 0 when the device was auto)
# Several at once: bash tools/dp-check.sh build equal scale. Exit status: number of failures.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=$PWD/.nccl/lib:$PWD/.deps/lib:${LD_LIBRARY_PATH:-}
T=build/train
STEPS=${STEPS:-20}
fails=0
note() { echo "== $*" | tee -a "$OUT/summary.txt"; }
cmp_runs() {  # cmp_runs NAME DIR1 DIR2 TOL
  local r
  r=$(python3 tools/dp_compare.py "$2/metrics.jsonl" "$3/metrics.jsonl" --tol "$4" 2>&1) || fails=$((fails + 1))
  note "$1: $r"
}
run() {  # run LOGNAME ARGS...: ./train with a time limit
  local name=$1
  shift
  timeout ${RUN_LIMIT:-120} $T "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { note "$name: exit $rc"; tail -5 "$OUT/$name.log" | tee -a "$OUT/summary.txt"; fails=$((fails + 1)); }
  return $rc
}
MIM_SMALL="--train.steps=$STEPS --train.cuda_graph=true --data.workers=2"
VLM_SMALL="--train.steps=$STEPS --data.workers=2"
for what in "$@"; do
  case "$what" in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
      # NCCL: the CUDA toolkit's or the system's; else the library of a Python wheel (nvidia.nccl)
      # with a header in .nccl/include, through NCCL_ROOT=.nccl
      if ! ls /usr/local/cuda/lib*/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* > /dev/null 2>&1; then
        L=$(python3 -c "import nvidia.nccl as n, glob; print(sorted(glob.glob(n.__path__[0] + '/lib/libnccl.so*'))[0])" 2>/dev/null)
        if [ -n "$L" ]; then
          mkdir -p .nccl/lib && ln -sf "$L" .nccl/lib/libnccl.so && ln -sf "$L" .nccl/lib/libnccl.so.2
          export NCCL_ROOT=$PWD/.nccl LD_LIBRARY_PATH=$PWD/.nccl/lib:$LD_LIBRARY_PATH
        fi
        echo "NCCL library: ${L:-none found}" | tee -a "$OUT/summary.txt"
      fi
      [ -f .nccl/include/nccl.h ] && export NCCL_ROOT=$PWD/.nccl
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_CUDA_ARCH=90 \
        > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      grep -i "nccl" "$OUT/configure.log" | tee -a "$OUT/summary.txt"
      cmake --build build -j "$(nproc)" --target train ${BUILD_TESTS:+test_distributed test_data_parallel} > "$OUT/build.log" 2>&1 \
        || { grep -E "error" "$OUT/build.log" | head -40; exit 1; }
      note "build ok" ;;
    equal|bf16)
      if [ "$what" = equal ]; then dt=f32; tol=${F32_TOL:-1e-5}; else dt=bf16; tol=${BF16_TOL:-2e-2}; fi
      export LOOM_DETERMINISTIC=1
      run mim_${dt}_1gpu bench_mim.cfg --train.dtype=$dt --train.batch_size=32 $MIM_SMALL --train.out_dir=runs/dp_mim_${dt}_1 &&
      run mim_${dt}_2gpu bench_mim.cfg --train.dtype=$dt --train.batch_size=16 --train.gpus=2 $MIM_SMALL --train.out_dir=runs/dp_mim_${dt}_2 &&
      cmp_runs "mim $dt, 1 GPU x 32 vs 2 GPUs x 16" runs/dp_mim_${dt}_1 runs/dp_mim_${dt}_2 $tol
      run vlm_${dt}_1gpu bench_vlm_sft.cfg --train.dtype=$dt --train.batch_size=4 $VLM_SMALL --train.out_dir=runs/dp_vlm_${dt}_1 &&
      run vlm_${dt}_2gpu bench_vlm_sft.cfg --train.dtype=$dt --train.batch_size=2 --train.gpus=2 $VLM_SMALL --train.out_dir=runs/dp_vlm_${dt}_2 &&
      cmp_runs "vlm_sft $dt, 1 GPU x 4 rows vs 2 GPUs x 2 rows" runs/dp_vlm_${dt}_1 runs/dp_vlm_${dt}_2 $tol
      unset LOOM_DETERMINISTIC
      cp runs/dp_*_${dt}_*/metrics.jsonl "$OUT/" 2>/dev/null
      for d in runs/dp_*_${dt}_*; do cp $d/metrics.jsonl "$OUT/$(basename $d).metrics.jsonl" 2>/dev/null; done ;;
    scale)
      S=${SCALE_STEPS:-15}
      for w in mim vlm_sft; do
        run bench_${w}_1gpu bench_$w.cfg --train.steps=$S --train.out_dir=runs/dp_bench_${w}_1 &&
        run bench_${w}_2gpu bench_$w.cfg --train.steps=$S --train.gpus=2 --train.out_dir=runs/dp_bench_${w}_2 &&
        run bench_${w}_2gpu_after bench_$w.cfg --train.steps=$S --train.gpus=2 --train.dist_bucket_mb=0 \
          --train.out_dir=runs/dp_bench_${w}_2after || continue
        r1=$(python3 tools/dp_compare.py --rate runs/dp_bench_${w}_1/metrics.jsonl 5)
        r2=$(python3 tools/dp_compare.py --rate runs/dp_bench_${w}_2/metrics.jsonl 5)
        r3=$(python3 tools/dp_compare.py --rate runs/dp_bench_${w}_2after/metrics.jsonl 5)
        note "bench_$w: 1 GPU $r1/s, 2 GPUs $r2/s (global), speed-up $(python3 -c "print(f'{$r2/$r1:.2f}x')"); with one average after the backward (train.dist_bucket_mb=0) $r3/s, $(python3 -c "print(f'{$r3/$r1:.2f}x')")"
        grep -h "gradient buckets" "$OUT/bench_${w}_2gpu.log" | head -1 | sed 's/^/  /' | tee -a "$OUT/summary.txt"
        grep -h "peak" "$OUT/bench_${w}_1gpu.log" | tail -1 | sed 's/^/  1 GPU last step: /' | tee -a "$OUT/summary.txt"
        grep -h "peak" "$OUT/bench_${w}_2gpu.log" | tail -1 | sed 's/^/  2 GPUs last step: /' | tee -a "$OUT/summary.txt"
        for d in runs/dp_bench_${w}_*; do cp $d/metrics.jsonl "$OUT/$(basename $d).metrics.jsonl"; done
      done ;;
    zero)
      S=${SCALE_STEPS:-15}
      for w in mim vlm_sft; do
        for z in 0 1; do
          LOOM_DETERMINISTIC=1 run zero${z}_${w}_f32 bench_$w.cfg --train.dtype=f32 --train.steps=$S --train.gpus=2 \
            --train.zero_stage=$z --train.out_dir=runs/dp_zero${z}_${w}_f32
          run zero${z}_${w} bench_$w.cfg --train.steps=$S --train.gpus=2 --train.zero_stage=$z --train.out_dir=runs/dp_zero${z}_$w
        done
        cmp_runs "bench_$w f32, 2 GPUs, ZeRO-1 vs not" runs/dp_zero0_${w}_f32 runs/dp_zero1_${w}_f32 ${F32_TOL:-1e-5}
        r0=$(python3 tools/dp_compare.py --rate runs/dp_zero0_$w/metrics.jsonl 5)
        r1=$(python3 tools/dp_compare.py --rate runs/dp_zero1_$w/metrics.jsonl 5)
        note "bench_$w, 2 GPUs: $r0/s unsharded, $r1/s with ZeRO-1 ($(python3 -c "print(f'{$r1/$r0:.3f}x')"))"
        for z in 0 1; do
          grep -h "peak" "$OUT/zero${z}_$w.log" | tail -1 | sed "s/^/  zero_stage=$z last step: /" | tee -a "$OUT/summary.txt"
          cp runs/dp_zero${z}_$w/metrics.jsonl "$OUT/dp_zero${z}_$w.metrics.jsonl"
        done
      done ;;
    infonce)
      export LOOM_DETERMINISTIC=1
      C="--model.contrastive=true --train.dtype=f32 $MIM_SMALL"
      run cmim_1gpu bench_mim.cfg $C --train.batch_size=32 --train.out_dir=runs/dp_cmim_1 &&
      run cmim_2gpu_global bench_mim.cfg $C --train.batch_size=16 --train.gpus=2 --train.dist_infonce=global \
        --train.out_dir=runs/dp_cmim_2g &&
      cmp_runs "contrastive mim f32, 1 GPU x 32 vs 2 GPUs x 16, global InfoNCE" runs/dp_cmim_1 runs/dp_cmim_2g ${F32_TOL:-1e-5}
      run cmim_2gpu_local bench_mim.cfg $C --train.batch_size=16 --train.gpus=2 --train.out_dir=runs/dp_cmim_2l &&
      note "contrastive mim f32, 1 GPU x 32 vs 2 GPUs x 16, local InfoNCE (expected to differ): $(python3 tools/dp_compare.py \
        runs/dp_cmim_1/metrics.jsonl runs/dp_cmim_2l/metrics.jsonl --tol ${F32_TOL:-1e-5} 2>&1)"
      unset LOOM_DETERMINISTIC ;;
    nodes)
      command -v torchrun > /dev/null || { note "nodes: no torchrun here"; continue; }
      export LOOM_DETERMINISTIC=1
      [ -f runs/dp_mim_f32_1/metrics.jsonl ] || run mim_f32_1gpu bench_mim.cfg --train.dtype=f32 --train.batch_size=32 \
        $MIM_SMALL --train.out_dir=runs/dp_mim_f32_1
      P=$((20000 + RANDOM % 20000))
      A="bench_mim.cfg --train.dtype=f32 --train.batch_size=16 $MIM_SMALL --train.out_dir=runs/dp_mim_nodes"
      for k in 0 1; do
        CUDA_VISIBLE_DEVICES=$k NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 150 torchrun --nnodes=2 --node_rank=$k \
          --nproc_per_node=1 --master_addr=127.0.0.1 --master_port=$P --no-python $T $A > "$OUT/nodes_$k.log" 2>&1 &
      done
      wait
      grep -h "NET/\|transport\|via" "$OUT"/rank_*.log 2>/dev/null | head -3
      cp runs/dp_mim_nodes/metrics.jsonl "$OUT/dp_mim_nodes.metrics.jsonl" 2>/dev/null
      [ -f runs/dp_mim_f32_2/metrics.jsonl ] && cmp_runs "mim f32, torchrun 2 nodes (sockets) vs --train.gpus=2" runs/dp_mim_f32_2 runs/dp_mim_nodes ${F32_TOL:-1e-5}
      [ -f runs/dp_mim_f32_1/metrics.jsonl ] && cmp_runs "mim f32, torchrun 2 nodes (sockets) vs 1 GPU x 32" runs/dp_mim_f32_1 runs/dp_mim_nodes ${F32_TOL:-1e-5}
      unset LOOM_DETERMINISTIC ;;
    fault)
      D=runs/dp_fault
      rm -rf $D
      P=$((20000 + RANDOM % 20000))
      A="bench_mim.cfg --train.steps=3000 --train.stop_at=120 --train.batch_size=64 --train.save_every=20 --train.log_every=20 --train.out_dir=$D"
      for k in 0 1; do
        RANK=$k LOCAL_RANK=$k WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$P \
          $T $A > "$OUT/fault_rank$k.log" 2>&1 &  # no wrapper: kill -9 must hit ./train itself
        eval pid$k=$!
      done
      for i in $(seq 1 600); do [ -n "$(ls $D 2>/dev/null | grep '^step_000000[4-9]0$')" ] && break; sleep 0.1; done
      t0=$(date +%s.%N)
      kill -9 $pid1
      wait $pid0
      rc0=$?
      t1=$(date +%s.%N)
      note "fault: kill -9 of rank 1 -> rank 0 exit $rc0 after $(python3 -c "print(f'{$t1-$t0:.1f}')") s: $(grep -h '^error' "$OUT/fault_rank0.log" | head -1)"
      [ $rc0 -ne 0 ] || fails=$((fails + 1))
      ls $D | tr '\n' ' ' | sed 's/^/  checkpoints: /' | tee -a "$OUT/summary.txt"; echo | tee -a "$OUT/summary.txt"
      run fault_resume bench_mim.cfg --train.steps=3000 --train.stop_at=120 --train.batch_size=64 --train.save_every=20 --train.log_every=20 \
        --train.out_dir=$D --train.resume=latest --train.gpus=2 && note "fault: resumed with --train.gpus=2: $(grep -h 'resumed from' "$OUT/fault_resume.log")"
      grep -h "step   120" "$OUT/fault_resume.log" | head -1 | tee -a "$OUT/summary.txt" ;;
    auto)
      for dt in bf16 fp16; do
        rm -rf runs/dp_auto_$dt
        run auto_$dt vlm_sft.cfg --train.dtype=$dt --train.gpus=2 --train.steps=60 --train.out_dir=runs/dp_auto_$dt &&
          note "vlm_sft.cfg (device auto) $dt on 2 GPUs: $(grep -hE '^data parallel: [0-9]' "$OUT/auto_$dt.log" | head -1 | cut -c1-90); $(grep -hE '^  all' "$OUT/auto_$dt.log" | tail -1)"
      done ;;
    *) echo "unknown: $what"; exit 2 ;;
  esac
done
note "failures: $fails"
exit $fails
