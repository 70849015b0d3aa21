#!/usr/bin/env bash
# One H200, one call: the issue-31 regimes of the 8-layer benchmark (30B-A3B geometry, EP 1, compile, triton tier,
# 4 x 4096 tokens per step) on this checkout, and the same on an older tree (OLD, `git archive` of a commit that
# speaks the same flags) for the regimes named in OLD_RUNS. JSON in $OUT; a table at the end.
#   mkdir -p .bench_old && git archive <commit> packages apps | tar -x -C .bench_old
#   RUNS="mb4 mb4_selective mb4_full mb2" OLD_RUNS="mb2" bash benchmarks/regimes_1gpu.sh
# ROUNDS=N (default 1): N rounds, old and new in turn in each (files *_r1 ... *_rN), so that the machine's drift
# over a call (power, clock, host) falls on both trees; the table adds each regime's median over the rounds.
# EXTRA: more job keys for every run, e.g. the expert shapes one GPU of EP 8 runs (16 local experts, ~2,048 rows
# each at micro-batch 1): EXTRA="--model.overrides.num_experts=16" (the all-to-all is not modelled).
set -u
OLD=${OLD:-.bench_old}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
path_of() { ls -d "$1"/packages/*/src "$1"/apps/*/src | tr '\n' ':'; }
flags() {  # the job's keys of one regime:
  # mb<M>[_selective|_selective_mlp|_selective_activation|_full|_full_recompute|_documents][_fa4][_cpp]
  # (_selective: the tree's default recompute; _full_recompute: full without parallel.keep_attention; documents:
  # packed, mean DOC_MEAN tokens; _fa4: parallel.attention_kernel=fa4, with benchmarks/fa4_env.sh sourced first;
  # _cpp: Inductor's C++ wrapper, TORCHINDUCTOR_CPP_WRAPPER=1, set in bench)
  local r=${1%_cpp} fa4=
  if [[ $r == *_fa4 ]]; then r=${r%_fa4}; fa4="--parallel.attention_kernel=fa4"; fi
  local mb=${r%%_*} ac=none docs=
  case $r in
    *_selective) ac=selective ;;
    *_selective_mlp|*_selective_activation) ac="selective --parallel.selective_recompute=${r##*_}" ;;
    *_full) ac=full ;;
    *_full_recompute) ac="full --parallel.keep_attention=false" ;;
    *_documents) docs="--documents ${DOC_MEAN:-1024}" ;;
  esac
  echo "--parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=${mb#mb}" \
    "--parallel.activation_checkpointing=$ac $docs $fa4"
}
bench() {  # bench NAME TREE REGIME
  TORCHINDUCTOR_CPP_WRAPPER=$([[ $3 == *_cpp ]] && echo 1 || echo 0) PYTHONPATH="$(path_of "$2")${MOESHARD_EXTRA_PATH:-}" timeout "${T:-200}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m moeshard.train bench --steps "${STEPS:-12}" --warmup "${WARMUP:-4}" $(flags "$3") ${EXTRA:-} --out "$OUT/$1.json" 2>&1 \
    | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "/tmp/$1.log"
  echo "$1: $(grep 'tok/s/GPU' "/tmp/$1.log" | tail -n 1)"
  grep "SM clock" "/tmp/$1.log" | tail -n 1 | sed "s/^/  /"  # the power cap's hold on the timed steps
  grep -q "tok/s/GPU" "/tmp/$1.log" || tail -n 15 "/tmp/$1.log"
}
for round in $(seq 1 "${ROUNDS:-1}"); do
  tag=$([ "${ROUNDS:-1}" -gt 1 ] && echo "_r$round")
  for r in ${OLD_RUNS:-}; do bench "old_$r$tag" "$OLD" "$r"; done
  for r in ${RUNS:-mb4 mb1}; do bench "new_$r$tag" "$PWD" "$r"; done
done
python3 "$(dirname "${BASH_SOURCE[0]}")/bench_table.py" "$OUT"
