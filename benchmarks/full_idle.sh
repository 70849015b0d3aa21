#!/usr/bin/env bash
# One H200, one call: where full checkpointing's forward idles (8 layers of 30B-A3B, EP 1, compile, triton tier,
# micro-batch 4). GPU-only traces of two steady steps (bench leaves out the first step after its timed loop, which
# starts from an empty launch queue), full checkpointing and none; a CPU + CUDA trace of full checkpointing with the
# host's work around each idle gap (benchmarks/host_gaps.py; the profiler slows the host, so it names the host work,
# not its length); then benchmarks/host_phases.py with stack samples, full checkpointing.
#   bash benchmarks/full_idle.sh        (summaries in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
FLAGS="--parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=${MB:-4}"
filter() { grep -v "UserWarning\|warnings.warn\|_rng_tracker\|AVOID_RECORD\|_warn_once"; }
trace() {  # name, activation checkpointing, extra bench flags
  timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m moeshard.train bench $FLAGS \
    --parallel.activation_checkpointing="$2" --steps 6 --warmup 3 --trace "/tmp/t_$1.json.gz" --out "$OUT/$1.json" \
    "${@:3}" 2>&1 | filter > "$OUT/$1.log"
  echo "$1: $(grep 'tok/s/GPU' "$OUT/$1.log" | tail -n 1)"
}
for ac in ${GPU_AC-none full}; do
  trace "gpu_$ac" "$ac" --trace-steps 2 --trace-gpu-only
  python3 benchmarks/trace_summary.py "/tmp/t_gpu_$ac.json.gz" --top 20 > "$OUT/sum_gpu_$ac.txt" 2>&1
  sed -n 1,4p "$OUT/sum_gpu_$ac.txt"; grep -A 16 "compute-stream idle per" "$OUT/sum_gpu_$ac.txt"
done
if [ -n "${CPU_AC-full}" ]; then
  trace "cpu_full" full --trace-steps 2
  python3 benchmarks/host_gaps.py /tmp/t_cpu_full.json.gz --min-gap-ms 0.1 > "$OUT/gaps_cpu_full.txt" 2>&1
  head -n 60 "$OUT/gaps_cpu_full.txt"
fi
for ac in ${PHASES_AC-full}; do
  HOST_PHASES_SAMPLE=1 timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/host_phases.py bench $FLAGS --parallel.activation_checkpointing="$ac" --steps 10 --warmup 4 \
    --out "$OUT/hp_$ac.json" 2>&1 | filter > "$OUT/hp_$ac.log"
  echo "host phases $ac: $(grep 'tok/s/GPU' "$OUT/hp_$ac.log" | tail -n 1)"
  grep "^host:" "$OUT/hp_$ac.log"
done
