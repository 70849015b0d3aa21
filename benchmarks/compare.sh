#!/usr/bin/env bash
# Before/after in one device call: the 8-layer benchmark of another source tree (OLD, e.g. a `git archive` of the
# previous commit) and of this checkout, interleaved old/new/old/new so that drift between runs shows.
#   mkdir -p .bench_old && git archive <commit> packages apps | tar -x -C .bench_old   (here; .bench_old is ignored)
#   OLD=.bench_old bash benchmarks/compare.sh      (on a machine with 2 GPUs; logs and JSON land in $OUT)
# Layouts: EP 2 x ep_fsdp 1 and EP 1 x ep_fsdp 2 (LAYOUTS="2 1"), 16 timed steps after 6, --compile; on one GPU:
# NPROC=1 LAYOUTS=1. ROUNDS="a b" (the default) runs each pair twice; MB=1 for micro-batch 1 (OUT per MB).
set -u
OLD=${OLD:-.bench_old}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# The same job in each tree's words: the job's keys (--section.key=value) since 0.4, bench's own flags before.
S_NEW="--model.overrides.num_hidden_layers=8 --steps ${STEPS:-22} --warmup 6 --parallel.compile=true --parallel.ep.kernels=triton"
S_OLD="--layers 8 --steps ${STEPS:-22} --warmup 6 --compile"
# MB=1: micro-batch 1 (of the 4 sequences per GPU) in both trees' words.
flags_of() {  # flags_of TREE EP_SIZE
  if grep -rqs "BENCH_JOB" "$1/apps/train/src"; then
    echo "$S_NEW --parallel.ep_size=$2${MB:+ --train.micro_batch_size=$MB}"
  else
    echo "$S_OLD --ep-size $2${MB:+ --micro-batch $MB}"
  fi
}
path_of() {  # every package's src of the tree (a tree may have more packages than another)
  ls -d "$1"/packages/*/src "$1"/apps/*/src | tr '\n' ':'
}
bench() {  # bench NAME TREE EP_SIZE
  local name=$1 tree=$2 ep=$3
  PYTHONPATH="$(path_of "$tree")" timeout "${T:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
    -m moeshard.train bench $(flags_of "$tree" "$ep") --out "$OUT/$name.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "$OUT/$name.log"
  tail -n 1 "$OUT/$name.log"
}
for ep in ${LAYOUTS:-2 1}; do
  for round in ${ROUNDS:-a b}; do
    bench "old_ep${ep}_$round" "$OLD" "$ep"
    bench "new_ep${ep}_$round" "$PWD" "$ep"
  done
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'run':<14}{'tokens/s/GPU':>14}{'step s':>10}{'peak GiB':>10}{'syncs':>7}  losses")
for f in sorted(out.glob("*_ep*_*.json")):
    d = json.loads(f.read_text())
    tps = d.get("tokens_per_s_per_gpu") or d.get("tokens_per_sec_per_gpu")
    step = d.get("step_time_s_median") or d.get("step_ms_median")
    mem = d.get("peak_reserved_gib") or d.get("max_reserved_gib")
    losses = d.get("losses", [])[:6]
    fmt = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else str(v)
    syncs = d.get("syncs_per_step")
    print(f"{f.stem:<14}{fmt(tps, '.0f'):>14}{fmt(step, '.4f'):>10}{fmt(mem, '.1f'):>10}{syncs!s:>7}  {losses}")
EOF
