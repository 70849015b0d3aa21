"""Qwen3-MoE's HF checkpoints: its :class:`HFFormat` for the shared loader and writer (``moeshard.models.common``).

The loading itself (both expert layouts, EP slices, FSDP shards, the whole plan checked before the first byte) is
``moeshard.models.common.load_hf_weights``, re-exported here.
"""

from __future__ import annotations

import os

from transformers import Qwen3MoeConfig

from moeshard.models.common import CheckpointError, HFFormat, LoadReport, load_hf_weights, local_region
from moeshard.models.common import load_hf_config as _load_hf_config
from moeshard.models.qwen3moe._presets import MODEL_TYPE, check_config, head_dim

__all__ = [
    "QWEN3_FORMAT",
    "STRUCTURAL_CONFIG_KEYS",
    "CheckpointError",
    "LoadReport",
    "load_hf_config",
    "load_hf_weights",
    "local_region",
]

STRUCTURAL_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "decoder_sparse_step",
    "mlp_only_layers",
)
"""Config fields that decide parameter shapes: two configs that differ in one describe different models (used
to give a clearer error than a shape mismatch when loading or resuming)."""


def _field(config: Qwen3MoeConfig, name: str) -> object:
    if name == "head_dim":
        return head_dim(config)
    if name == "mlp_only_layers":
        return sorted(config.mlp_only_layers or [])
    return getattr(config, name, None)


QWEN3_FORMAT = HFFormat(
    model_type=MODEL_TYPE,
    architecture="Qwen3MoeForCausalLM",
    config_class=Qwen3MoeConfig,
    check_config=check_config,
    structural_keys=STRUCTURAL_CONFIG_KEYS,
    num_experts=lambda config: config.num_experts,
    field=_field,
)
"""Qwen3-MoE's checkpoints (``Qwen3MoeForCausalLM.hf_format``)."""


def load_hf_config(path: str | os.PathLike) -> Qwen3MoeConfig:
    """Read and check ``config.json`` of a local HF Qwen3-MoE checkpoint directory.

    Raises:
        FileNotFoundError: no such directory, or no config.json in it.
        CheckpointError: invalid JSON or ``model_type`` other than ``qwen3_moe``.
        ValueError: a config feature this model does not implement (see ``check_config``).
    """
    return _load_hf_config(path, QWEN3_FORMAT)
