#!/usr/bin/env bash
# Micro-batch and activation-checkpointing sweep at the same tokens per step, in one device call, and a GPU-only
# trace of one step at micro-batch 1 and 4 (summarised by benchmarks/trace_summary.py), next to `plan`'s estimate.
#   NPROC=1 EP=1 bash benchmarks/microbatch.sh          (logs, JSON and trace summaries land in $OUT)
#   TREE=.bench_new bash benchmarks/microbatch.sh       (another source tree, e.g. a `git archive` of a commit)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
R=$(cd "${TREE:-.}" && pwd)
export PYTHONPATH="$(ls -d "$R"/packages/*/src "$R"/apps/*/src | tr '\n' ':')"
L=${LAYERS:-8}; EP=${EP:-1}; N=${NPROC:-1}
S="--model.overrides.num_hidden_layers=$L --steps ${STEPS:-16} --warmup 5 --parallel.compile=true --parallel.ep.kernels=triton --parallel.ep_size=$EP --batch-per-gpu 4"
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timeout "${T:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$N" \
    -m moeshard.train bench $S "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "$OUT/$name.log"
  echo "$name: $(tail -n 1 "$OUT/$name.log")"
  grep -q "tok/s/GPU" "$OUT/$name.log" || tail -n 25 "$OUT/$name.log"
}
plan() {  # plan MICRO_BATCH [POLICY]
  python3 -m moeshard.train plan --nnodes 1 --nproc-per-node "$N" --micro-batch-size "$1" \
    --model.preset=qwen3-30b-a3b "--model.overrides={\"num_hidden_layers\": $L}" --data.seq_len=4096 \
    --train.global_batch_size=$((4 * N)) --parallel.ep_size="$EP" --parallel.param_dtype=bfloat16 \
    --parallel.activation_checkpointing="${2:-none}" 2>/dev/null \
    | grep -E "^  (activations|total)" | tr -s ' ' | tr '\n' ' '
}
for mb in 4 2 1; do
  bench "mb$mb" --train.micro_batch_size="$mb"
  echo "  plan mb$mb: $(plan $mb)"
done
for policy in full selective; do
  for mb in 4 1; do
    bench "mb${mb}_$policy" --train.micro_batch_size="$mb" --parallel.activation_checkpointing="$policy"
    echo "  plan mb$mb $policy: $(plan "$mb" "$policy")"
  done
done
for mb in ${TRACE_MB:-1 4}; do
  bench "trace_mb$mb" --train.micro_batch_size="$mb" --steps 8 --warmup 4 --trace "$OUT/trace_mb$mb.json.gz" --trace-gpu-only
  python3 "$R/benchmarks/trace_summary.py" "$OUT/trace_mb$mb.json.gz" --top 25 > "$OUT/trace_mb$mb.txt" 2>&1
  rm -f "$OUT/trace_mb$mb.json.gz"
done
rm -f "$OUT"/*.log "$OUT"/trace_mb*.json  # at most 8 files come back from the device: the sweep's JSON and the summaries
