#!/usr/bin/env bash
# Device call: EP 2 benchmark eager vs compiled pointwise kernels (profile of the compiled one), then the
# prefetch comparison (EP 1 x ep_fsdp 2, depth 0/1/2).
set -u
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() { name=$1; shift; timeout ${T:-300} python3 -m torch.distributed.run --standalone "$@" 2>&1 | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD" | tee "$OUT/$name.log" | tail -${TAILN:-6}; }
bench ep2 --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 2 --steps 8 --warmup 3 --out "$OUT/ep2.json"
TAILN=40 bench ep2c --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 2 --steps 8 --warmup 3 --compile --out "$OUT/ep2c.json" --profile "$OUT/ep2c_profile.txt"
TAILN=30 bench prefetch --nproc-per-node 2 benchmarks/prefetch_profile.py --ep-size 1 --depths 0,1 --out "$OUT/prefetch.json"
