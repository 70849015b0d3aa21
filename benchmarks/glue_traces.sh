#!/usr/bin/env bash
# One H200, one call: GPU-only kernel traces of the 8-layer benchmark (30B-A3B geometry, EP 1, compile, triton
# tier, 4 x 4096 tokens per step) at micro-batch 4 and 1 x 4, summarised by benchmarks/trace_summary.py, then,
# while DEADLINE (seconds since the start) allows, micro-batch 1 x 4 with full checkpointing under
# benchmarks/host_phases.py with Inductor's Python and C++ wrappers, alternating.
#   bash benchmarks/glue_traces.sh        (summaries and JSON in $OUT; the headline figures printed)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; DEADLINE=${DEADLINE:-480}; start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
FLAGS="--parallel.compile=true --parallel.ep.kernels=triton"
filter() { grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for mb in ${MBS:-4 1}; do
  timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train bench $FLAGS \
    --train.micro_batch_size="$mb" --steps 10 --warmup 4 --trace "$OUT/t_mb$mb.json.gz" --trace-gpu-only \
    --out "$OUT/mb$mb.json" 2>&1 | filter > "/tmp/mb$mb.log"
  echo "mb$mb: $(grep 'tok/s/GPU' "/tmp/mb$mb.log" | tail -n 1)"
  python3 benchmarks/trace_summary.py "$OUT/t_mb$mb.json.gz" --top 45 > "$OUT/sum_mb$mb.txt" 2>&1
  sed -n 1,25p "$OUT/sum_mb$mb.txt"
done
i=0
while [ $((SECONDS - start)) -lt "$DEADLINE" ] && [ "$i" -lt "${PAIRS:-2}" ]; do
  for cpp in 0 1; do
    name="hp_full_mb1_cpp${cpp}_$i"
    HOST_PHASES_CPP_WRAPPER=$([ $cpp = 1 ] && echo 1) timeout 200 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 benchmarks/host_phases.py bench $FLAGS --train.micro_batch_size=1 \
      --parallel.activation_checkpointing=full --steps 10 --warmup 4 --out "$OUT/$name.json" 2>&1 | filter \
      > "$OUT/$name.log"
    echo "$name: $(grep 'tok/s/GPU' "$OUT/$name.log" | tail -n 1) | $(grep -m1 'train_step' "$OUT/$name.log")"
  done
  i=$((i + 1))
done
