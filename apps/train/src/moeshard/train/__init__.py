"""moeshard.train: the torchrun training job composing meshes, ep, fsdp_moe, prefetch and the Qwen3-MoE model.

torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml
moeshard-train plan --config apps/train/configs/qwen3_30b_a3b_2x8.yaml --nnodes 2 --nproc-per-node 8
"""

from moeshard.train.config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
