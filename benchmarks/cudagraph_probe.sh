#!/usr/bin/env bash
# One H200, one call: the 8-layer benchmark (30B-A3B geometry, EP 1, compile, triton tier, 4 x 4096 tokens per step)
# as shipped and with the attention halves as CUDA graphs (benchmarks/cudagraph_probe.py), side by side per
# micro-batch size; then, with HOST_PHASES=1, benchmarks/host_phases.py at micro-batch 1. JSON in $OUT.
#   MBS="1 4 2" bash benchmarks/cudagraph_probe.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
F="--parallel.compile=true --parallel.ep.kernels=triton ${EXTRA:-}"
run() {  # run NAME TARGET... (bench's flags follow)
  local name=$1; shift
  timeout "${T:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 "$@" \
    --steps "${STEPS:-12}" --warmup "${WARMUP:-4}" --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "/tmp/$name.log"
  echo "$name: $(grep 'tok/s/GPU' "/tmp/$name.log" | tail -n 1)"
  grep -q "tok/s/GPU" "/tmp/$name.log" || tail -n 25 "/tmp/$name.log"
  grep -A6 "^cudagraph_probe" "/tmp/$name.log"
}
for mb in ${MBS:-1 4}; do
  for v in ${VARIANTS:-plain cg}; do
    if [ "$v" = plain ]; then run "plain_mb$mb" -m moeshard.train bench $F --train.micro_batch_size="$mb"
    else run "cg_mb$mb" benchmarks/cudagraph_probe.py bench $F --train.micro_batch_size="$mb"; fi
  done
done
if [ -n "${HOST_PHASES:-}" ]; then
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/host_phases.py bench $F \
    --train.micro_batch_size=1 --steps 10 --warmup 4 2>&1 | grep "^host:" | head -40
fi
python3 "$(dirname "${BASH_SOURCE[0]}")/bench_table.py" "$OUT"
