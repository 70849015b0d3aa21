"""Named Qwen3.5-MoE configurations, the checks our model makes on a config, and its layer kinds.

Configs are transformers' ``Qwen3_5MoeTextConfig`` (its defaults are the 35B-A3B geometry), so the text config of a
Hub folder reads unchanged::

    cfg = get_preset_config("qwen3.5-35b-a3b")                    # 40 layers, 3 of 4 Gated DeltaNet
    cfg = get_preset_config("tiny", num_hidden_layers=4)          # tests; any field can be overridden

Parameter and FLOP counts are derived from the model (``FAMILY.count_parameters``, ``FAMILY.facts``), not written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import Qwen3_5MoeTextConfig

from moeshard.models.common import check_common_config, config_keys, preset_config

__all__ = ["LAYER_TYPES", "MODEL_TYPE", "PRESETS", "VL_MODEL_TYPE", "check_config", "get_preset_config", "is_moe_layer"]

MODEL_TYPE = "qwen3_5_moe_text"
"""The ``model_type`` of the configs (and text-model checkpoints) this package accepts."""
VL_MODEL_TYPE = "qwen3_5_moe"
"""The ``model_type`` of the vision-language folders whose language model this package loads."""
LAYER_TYPES = ("linear_attention", "full_attention")
"""The layer kinds of ``config.layer_types``: Gated DeltaNet, gated full attention."""

_FIELDS = {f.name for f in dataclasses.fields(Qwen3_5MoeTextConfig)}
# transformers' Qwen3_5MoeTextConfig() defaults: Qwen3.5-35B-A3B (40 layers, 256 experts top-8 plus a shared one).
_QWEN35_35B_A3B: dict[str, Any] = {
    k: v
    for k, v in Qwen3_5MoeTextConfig().to_dict().items()
    if k in _FIELDS and k not in ("transformers_version", "dtype", "layer_types")
}

# Small enough for CPU tests, with every feature of the real one: 3 DeltaNet layers and a gated attention layer,
# grouped value heads (4 per 2 key heads), GQA 4/2, partial rotary, 8 experts top-2 and the gated shared expert.
_TINY: dict[str, Any] = dict(
    _QWEN35_35B_A3B,
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

PRESETS: dict[str, dict[str, Any]] = {"qwen3.5-35b-a3b": _QWEN35_35B_A3B, "tiny": _TINY}
"""Preset name -> ``Qwen3_5MoeTextConfig`` fields (read through :func:`get_preset_config`)."""

_CONFIG_KEYS = config_keys(Qwen3_5MoeTextConfig, "rope_theta", "full_attention_interval")


def get_preset_config(name: str, **overrides: Any) -> Qwen3_5MoeTextConfig:
    """A ``Qwen3_5MoeTextConfig`` by preset name, with fields overridden by keyword (``num_hidden_layers=4``;
    ``layer_types`` follows ``full_attention_interval``, default 4, unless given).

    Raises:
        ValueError: unknown preset name or unknown override key.
    """
    return preset_config("Qwen3.5-MoE", PRESETS, Qwen3_5MoeTextConfig, check_config, _CONFIG_KEYS, name, overrides)


def is_moe_layer(config: Qwen3_5MoeTextConfig, layer_idx: int) -> bool:
    """Every Qwen3.5-MoE layer has routed experts."""
    return True


def check_config(config: Qwen3_5MoeTextConfig) -> None:
    """Refuse configs this model does not implement, each with the reason and the fix.

    Raises:
        ValueError: another architecture, or a feature we do not support.
    """
    check_common_config(config, MODEL_TYPE, "Qwen3.5-MoE")
    types = list(config.layer_types or [])
    if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(
            f"layer_types={types} must name one of {LAYER_TYPES} for each of the num_hidden_layers="
            f"{config.num_hidden_layers} layers; fix layer_types or leave it out (every 4th layer full attention)"
        )
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported (Qwen3.5-MoE uses 'default'); set it to 'default'")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} must be a multiple of num_key_value_heads="
            f"{config.num_key_value_heads}"
        )
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(
            f"linear_num_value_heads={config.linear_num_value_heads} must be a multiple of linear_num_key_heads="
            f"{config.linear_num_key_heads} (each key head serves a group of value heads)"
        )
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} must be in [1, num_experts={config.num_experts}]"
        )
