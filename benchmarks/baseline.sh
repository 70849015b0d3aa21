#!/usr/bin/env bash
# One device call: the benchmark at EP 2, EP 1 x ep_fsdp 2 (2 GPUs) and on 1 GPU; logs and JSON under $OUT.
set -u
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
bench() { name=$1; shift; timeout ${T:-240} python3 -m torch.distributed.run --standalone "$@" 2>&1 | grep -v "UserWarning\|warnings.warn\|_rng_tracker" | tee "$OUT/$name.log" | tail -${TAILN:-8}; }
bench ep2 --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 2 --steps 8 --warmup 3 --out "$OUT/ep2.json" ${EXTRA:-}
bench ep1x2 --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 1 --steps 8 --warmup 3 --out "$OUT/ep1x2.json" ${EXTRA:-}
bench gpu1 --nproc-per-node 1 -m moeshard.train bench --layers 8 --ep-size 1 --steps 8 --warmup 3 --out "$OUT/gpu1.json" --profile "$OUT/trace1.json" ${EXTRA:-}
