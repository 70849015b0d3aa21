#!/usr/bin/env bash
# The README table in one device call: EP 2 (with a profile), EP 1 x ep_fsdp 2 and 1 GPU, compiled kernels.
#   bash benchmarks/table.sh      (on a machine with 2 GPUs; logs, JSON and the profile land in $OUT)
set -u
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() { name=$1; shift; timeout ${T:-300} python3 -m torch.distributed.run --standalone "$@" 2>&1 | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD" | tee "$OUT/$name.log" | tail -${TAILN:-4}; }
TAILN=14 bench ep2c --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 2 --steps 10 --warmup 4 --compile --out "$OUT/ep2c.json" --profile "$OUT/ep2c_profile.txt" ${EXTRA:-}
bench ep1x2c --nproc-per-node 2 -m moeshard.train bench --layers 8 --ep-size 1 --steps 10 --warmup 4 --compile --out "$OUT/ep1x2c.json" ${EXTRA:-}
bench gpu1c --nproc-per-node 1 -m moeshard.train bench --layers 8 --ep-size 1 --steps 10 --warmup 4 --compile --out "$OUT/gpu1c.json" ${EXTRA:-}
