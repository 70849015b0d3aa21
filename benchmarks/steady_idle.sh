#!/usr/bin/env bash
# One H200, one call: the compute stream's idle in steady steps (bench --trace-gpu-only, 2 traced steps after
# bench's one untraced warm-up step) at each micro-batch size of MBS (8 layers of 30B-A3B, EP 1, compile, triton
# tier, 4 x 4096 tokens per step), summarised by benchmarks/trace_summary.py. Idle in steady steps is where the host
# sets the pace; none means the kernels do.
#   MBS="1 4" ACS="none full" TOP=60 bash benchmarks/steady_idle.sh   (ACS: activation_checkpointing values)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
for mb in ${MBS:-1 4}; do for ac in ${ACS:-none}; do
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train bench \
    --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size="$mb" --parallel.activation_checkpointing="$ac" ${EXTRA:-} --steps 6 \
    --warmup 3 --trace-steps 2 --trace "/tmp/t_mb${mb}_$ac.json.gz" --trace-gpu-only --out "$OUT/steady_mb${mb}_$ac.json" \
    > "$OUT/steady_mb${mb}_$ac.log" 2>&1
  echo "mb$mb $ac: $(grep 'tok/s/GPU' "$OUT/steady_mb${mb}_$ac.log" | tail -n 1)"
  if [ ! -f "/tmp/t_mb${mb}_$ac.json.gz" ]; then  # bench records GPU activity only
    echo "mb$mb $ac: no trace written"; tail -n 5 "$OUT/steady_mb${mb}_$ac.log"; continue
  fi
  sum=(python3 benchmarks/trace_summary.py "/tmp/t_mb${mb}_$ac.json.gz" --top "${TOP:-25}")
  # per step where the trace holds two optimizer ends (whole steps between them), else the window as it is
  "${sum[@]}" --steps-between adamw > "$OUT/steady_sum_mb${mb}_$ac.txt" 2>&1 || "${sum[@]}" > "$OUT/steady_sum_mb${mb}_$ac.txt" 2>&1
  sed -n 1,16p "$OUT/steady_sum_mb${mb}_$ac.txt"; grep -A 14 "compute-stream idle per" "$OUT/steady_sum_mb${mb}_$ac.txt"
done; done
