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
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'run':<16}{'tokens/s/GPU':>13}{'step ms':>9}{'host ms':>9}{'alloc':>7}{'reserved':>9}  losses")
for f in sorted(pathlib.Path(sys.argv[1]).glob("*mb*.json")):
    d = json.loads(f.read_text())
    print(f"{f.stem:<16}{d['tokens_per_s_per_gpu']:>13,.0f}{1000 * d['step_time_s_median']:>9.1f}"
          f"{1000 * (d.get('host_time_s_median') or 0):>9.1f}{d.get('peak_allocated_gib') or 0:>7.1f}"
          f"{d.get('peak_reserved_gib') or 0:>9.1f}  {[round(x, 4) for x in d.get('losses', [])[:6]]}")
PY
