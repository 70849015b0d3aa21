#!/usr/bin/env bash
# One GPU, one call: does pinning the job's host threads to a few CPUs change a host-paced step? Prints the
# machine's CPU topology, then runs each regime of RUNS under each CPU set of PINS (taskset -c; "all" = unpinned),
# ROUNDS times in turn (8 layers of 30B-A3B, EP 1, compile, triton tier, 4 x 4096 tokens per step).
#   RUNS="mb1" PINS="all 0-3 0-1" ROUNDS=2 bash benchmarks/host_pinning.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
nproc; lscpu | grep -i "model name\|^CPU(s)\|thread\|core\|socket\|numa\|MHz\|L3" ; for c in 0 1 2 8; do
  echo "cpu$c siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null)"; done
nvidia-smi topo -m 2>/dev/null | head -4
for round in $(seq 1 "${ROUNDS:-1}"); do
  for r in ${RUNS:-mb1}; do for p in ${PINS:-all 0-3}; do
    name="${r}_pin${p//,/_}_r$round"; mb=${r#mb}
    pin=(); [ "$p" != all ] && pin=(taskset -c "$p")
    t0=$(date +%s)
    "${pin[@]}" timeout "${T:-170}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train \
      bench --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size="$mb" ${EXTRA:-} \
      --steps "${STEPS:-10}" --warmup "${WARMUP:-4}" --out "$OUT/$name.json" 2>&1 \
      | grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once" > "/tmp/$name.log"
    echo "$name ($(( $(date +%s) - t0 )) s): $(grep 'tok/s/GPU' "/tmp/$name.log" | tail -n 1)"
    grep "host\|SM clock" "/tmp/$name.log" | tail -n 2 | sed "s/^/  /"
    grep -q "tok/s/GPU" "/tmp/$name.log" || tail -n 15 "/tmp/$name.log"
  done; done
done
python3 "$(dirname "$0")/bench_table.py" "$OUT" "*pin*.json"
