#!/usr/bin/env bash
# The README table in one device call: EP 2 (twice; the second with a GPU-only Chrome trace of one profiled step),
# EP 1 x ep_fsdp 2 and 1 GPU, compiled kernels, 16 timed steps after 6 warm-up steps each.
#   bash benchmarks/table.sh      (on a machine with 2 GPUs; logs, JSON and the trace land in $OUT)
set -u
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S="--model.overrides.num_hidden_layers=8 --steps ${STEPS:-22} --warmup 6 --parallel.compile=true --parallel.ep.kernels=triton"
bench() { name=$1; shift; timeout ${T:-300} python3 -m torch.distributed.run --standalone "$@" 2>&1 | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" | tee "$OUT/$name.log" | tail -${TAILN:-2}; }
bench ep2a --nproc-per-node 2 -m moeshard.train bench $S --parallel.ep_size=2 --out "$OUT/ep2a.json" ${EXTRA:-}
bench ep2b --nproc-per-node 2 -m moeshard.train bench $S --parallel.ep_size=2 --out "$OUT/ep2b.json" --trace "$OUT/ep2b.json.gz" --trace-gpu-only ${EXTRA:-}
bench ep1x2 --nproc-per-node 2 -m moeshard.train bench $S --parallel.ep_size=1 --out "$OUT/ep1x2.json" ${EXTRA:-}
bench gpu1 --nproc-per-node 1 -m moeshard.train bench $S --parallel.ep_size=1 --out "$OUT/gpu1.json" ${EXTRA:-}
python3 benchmarks/trace_summary.py "$OUT/ep2b.json.gz" --top 25 > "$OUT/ep2b_trace.txt" 2>&1; head -30 "$OUT/ep2b_trace.txt"
