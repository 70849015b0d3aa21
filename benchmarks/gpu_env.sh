# Source on a GPU machine whose python3 already has torch/transformers: puts every package's src on the path.
export PYTHONPATH="$PWD/packages/meshes/src:$PWD/packages/ep/src:$PWD/packages/fsdp_moe/src:$PWD/packages/prefetch/src:$PWD/packages/models_qwen3moe/src:$PWD/apps/train/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
