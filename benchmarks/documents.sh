#!/usr/bin/env bash
# Document-masked packing and real-data loading against plain causal rows, in one device call (issue: packed
# documents within 5% of unmasked tokens/s; real data within 2% of synthetic at the same shapes):
#   plain      synthetic rows, one causal sequence each (SDPA, today's benchmark)
#   documents  synthetic packed rows, log-normal document lengths of mean DOC_MEAN (flex_attention BlockMask)
#   data       a prepared corpus (CORPUS, made by `python -m moeshard.data prepare`) read through the job's loader
#              (PrefetchLoader, background thread); left out when CORPUS is not set
#   preload    the same rows, all read before the timed steps (what the loader costs: data vs preload)
#   NPROC=1 EP=1 CORPUS=/data/prepared bash benchmarks/documents.sh     (logs and JSON land in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
R=$PWD
export PYTHONPATH="$(ls -d "$R"/packages/*/src "$R"/apps/*/src | tr '\n' ':')"
CORPUS=${CORPUS:-}
[ -n "$CORPUS" ] || echo "documents.sh: CORPUS not set; the data and preload runs are left out"
S="--model.overrides.num_hidden_layers=${LAYERS:-8} --steps ${STEPS:-22} --warmup 6 --parallel.compile=true --parallel.ep.kernels=triton --parallel.ep_size=${EP:-1}"
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timeout "${T:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-1}" \
    -m moeshard.train bench $S "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "$OUT/$name.log"
  echo "$name: $(tail -n 1 "$OUT/$name.log")"
}
for round in ${ROUNDS:-a}; do
  bench "plain_$round"
  bench "documents_$round" --documents "${DOC_MEAN:-1024}"
  if [ -n "$CORPUS" ]; then
    bench "data_$round" --data.path="$CORPUS"
    bench "preload_$round" --data.path="$CORPUS" --preload
  fi
done
