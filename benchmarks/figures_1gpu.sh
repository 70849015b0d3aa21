#!/usr/bin/env bash
# One GPU, one call: the figure sets of docs/performance.md on this checkout, by name. JSON in $OUT; a table at the end.
#   JOBS="full lora" bash benchmarks/figures_1gpu.sh                  # full fine-tuning against LoRA, micro-batch 4
#   JOBS="s4k s16k s32k s64k s128k" bash benchmarks/figures_1gpu.sh   # long rows at sp 1, 65,536 tokens a step
#   JOBS="q3 oss q35" MB=2 bash benchmarks/figures_1gpu.sh            # the families beside Qwen3-30B-A3B
# Jobs: full, lora (rank 16 on attention + experts), s4k ... s128k (4,096 to 131,072 tokens a row; 64k and 128k with
# full activation checkpointing), l128k (LoRA at 128k), q3 / oss / q35 (Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-35B-A3B
# at micro-batch MB, default 2). LAYERS: decoder layers of each preset (default 8 on a GPU of 100 GB or more, else
# 6; the long rows and the families want fewer on an 80 GB GPU: LAYERS=4). Qwen3.5-MoE on GPU needs its `kernels`
# extra on the path (MOESHARD_EXTRA_PATH=:/dir/of/site-packages, CUDA_HOME for tilelang's nvcc).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
L=${LAYERS:-$([ "${MEM:-100000}" -lt 100000 ] && echo 6 || echo 8)}
PP="$(ls -d packages/*/src apps/*/src | paste -sd:)${MOESHARD_EXTRA_PATH:-}"
LORA="--lora.rank=16 --lora.alpha=32 --lora.target_modules=[q_proj,k_proj,v_proj,o_proj]
 --lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"
LONG="--model.overrides.max_position_embeddings=131072 --train.micro_batch_size=1"
FULL="--parallel.activation_checkpointing=full"
run() {  # run NAME KEYS...
  local name=$1 t0=$SECONDS; shift
  PYTHONPATH=$PP timeout "${T:-200}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m moeshard.train bench --steps "${STEPS:-10}" --warmup "${WARMUP:-4}" --parallel.compile=true \
    --parallel.ep.kernels=triton --model.overrides.num_hidden_layers="$L" "$@" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "$name ($((SECONDS - t0)) s): $(grep 'tok/s/GPU' "$OUT/$name.log" | tail -n 1)"
  grep -q "tok/s/GPU" "$OUT/$name.log" || tail -n 4 "$OUT/$name.log"
}
for job in ${JOBS:-full lora s4k s16k s32k s64k s128k}; do
  case $job in
    full) run full_mb4 --train.micro_batch_size=4 ;;
    lora) run lora_mb4 --train.micro_batch_size=4 $LORA ;;
    s4k) run s4k --batch-per-gpu 16 --train.micro_batch_size=4 ;;
    s16k) run s16k --batch-per-gpu 4 --data.seq_len=16384 $LONG ;;
    s32k) run s32k --batch-per-gpu 2 --data.seq_len=32768 $LONG ;;
    s64k) run s64k_full --batch-per-gpu 1 --data.seq_len=65536 $LONG $FULL ;;
    s128k) run s128k_full --batch-per-gpu 1 --data.seq_len=131072 $LONG $FULL ;;
    l128k) run lora_s128k_full --batch-per-gpu 1 --data.seq_len=131072 $LONG $FULL $LORA ;;
    q3) run "qwen3_mb${MB:-2}" --train.micro_batch_size="${MB:-2}" ;;
    oss) run "gptoss_mb${MB:-2}" --model.family=gpt_oss --model.preset=gpt-oss-20b --train.micro_batch_size="${MB:-2}" ;;
    q35) run "qwen35_mb${MB:-2}" --model.family=qwen3_5_moe_text --model.preset=qwen3.5-35b-a3b \
      --train.micro_batch_size="${MB:-2}" ;;
    *) echo "unknown job $job (full lora s4k s16k s32k s64k s128k l128k q3 oss q35)" >&2; exit 2 ;;
  esac
done
python3 benchmarks/bench_table.py "$OUT"
