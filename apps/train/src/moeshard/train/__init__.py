"""moeshard.train: the torchrun training job for the MoE families of ``moeshard.train.families`` (Qwen3-MoE, the
default, and the DeepSeek-V3 architecture), composing meshes, ep, fsdp_moe, prefetch, data, checkpoint and the
families' shared ``moeshard.models.common.parallelize``.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml
    torchrun --nproc-per-node 4 -m moeshard.train --model.family=deepseek_v3 --model.preset=tiny
    moeshard-train plan --config apps/train/configs/qwen3_30b_a3b_2x8.yaml --nnodes 2 --nproc-per-node 8
"""

from moeshard.train.config import ConfigError, JobConfig, load_config

__all__ = ["ConfigError", "JobConfig", "load_config"]
