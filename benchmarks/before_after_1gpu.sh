#!/usr/bin/env bash
# One H200, one call: the 8-layer benchmark (30B-A3B geometry, EP 1, compile, 4 x 4096 tokens per step) of an older
# tree (OLD, a `git archive` of a commit; bench's own flags) and of this checkout, at micro-batch 4 and 1. The new
# tree runs twice per micro-batch: with its defaults, and with the old defaults spelled out (gradient_sync
# every_micro_batch, reshard_after_forward true), which isolates a refactor from a change of defaults.
#   mkdir -p .bench_old && git archive <commit> packages apps | tar -x -C .bench_old
#   OLD=.bench_old bash benchmarks/before_after_1gpu.sh          (JSON land in $OUT; a table at the end)
# OLD_CLI=old for an old tree from before the job's keys on bench's command line (before f98cef0: --layers,
# --compile, --ep-size, --micro-batch); VARIANTS picks the new tree's runs ("olddefaults new"); MBS the micro-batch sizes.
set -u
OLD=${OLD:-.bench_old}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
STEPS=${STEPS:-12}; WARMUP=${WARMUP:-4}
path_of() { ls -d "$1"/packages/*/src "$1"/apps/*/src | tr '\n' ':'; }
bench() {  # bench NAME TREE ARGS...
  local name=$1 tree=$2; shift 2
  PYTHONPATH="$(path_of "$tree")" timeout "${T:-200}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m moeshard.train bench --steps "$STEPS" --warmup "$WARMUP" "$@" --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "/tmp/$name.log"
  echo "$name: $(tail -n 1 "/tmp/$name.log")"
  grep -q "tok/s/GPU" "/tmp/$name.log" || tail -n 15 "/tmp/$name.log"
}
NEW="--parallel.compile=true --parallel.ep.kernels=triton"
OLD_DEFAULTS="--train.gradient_sync=every_micro_batch --parallel.reshard_after_forward=true"
for mb in ${MBS:-4 1}; do
  if [ "${OLD_CLI:-new}" = new ]; then
    bench "old_mb$mb" "$OLD" $NEW --train.micro_batch_size="$mb"
  else
    bench "old_mb$mb" "$OLD" --layers 8 --compile --ep-size 1 --micro-batch "$mb"
  fi
  for v in ${VARIANTS:-olddefaults new}; do
    if [ "$v" = olddefaults ]; then
      bench "new_olddefaults_mb$mb" "$PWD" $NEW $OLD_DEFAULTS --train.micro_batch_size="$mb"
    else
      bench "new_mb$mb" "$PWD" $NEW --train.micro_batch_size="$mb"
    fi
  done
done
python3 "$(dirname "${BASH_SOURCE[0]}")/bench_table.py" "$OUT"
