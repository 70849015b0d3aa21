"""Named DeepSeek-V3 configurations, the checks our model makes on a config, and which layers have experts.

Configs are transformers' ``DeepseekV3Config``, so a ``config.json`` of DeepSeek-V3/R1, Kimi K2 or Moonlight reads
unchanged. One field transformers does not have: ``scoring_func`` (``"sigmoid"``, DeepSeek-V3's and the default,
or ``"softmax"``, DeepSeek-V2's and TorchTitan's 16B flavor's); the Hub configs of the V2/V3 family carry it.

    cfg = get_preset_config("deepseek-v3-16b")                    # TorchTitan's deepseek_v3 16B geometry
    cfg = get_preset_config("tiny", num_hidden_layers=3)          # tests; any field can be overridden

Parameter and FLOP counts are derived from the model (``FAMILY.count_parameters``, ``FAMILY.facts``), not written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import DeepseekV3Config

from moeshard.models.common import SCORING_FUNCS, check_common_config, config_keys, preset_config

__all__ = [
    "MODEL_TYPE",
    "PRESETS",
    "ROPE_TYPES",
    "check_config",
    "get_preset_config",
    "is_moe_layer",
    "scoring_func",
]

MODEL_TYPE = "deepseek_v3"
"""The ``model_type`` of the configs and checkpoints this package accepts."""
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
"""RoPE scalings the model implements (transformers' static ones: the tables do not change with the length)."""

# transformers' DeepseekV3Config() defaults: DeepSeek-V3 671B (61 layers, 3 dense, 256 experts top-8 in 8 groups).
_V3_671B: dict[str, Any] = {
    k: v
    for k, v in DeepseekV3Config().to_dict().items()
    if k in {f.name for f in dataclasses.fields(DeepseekV3Config)} and k not in ("transformers_version", "dtype")
}
_V3_671B["scoring_func"] = "sigmoid"

# TorchTitan's deepseek_v3 "16B" flavor (models/deepseek_v3/__init__.py), in transformers' field names: MLA without
# a query LoRA, 1 dense layer then 26 MoE layers of 64 experts top-6 (softmax, no groups) plus 2 shared experts;
# YaRN RoPE (factor 40 over 4096) with mscale 0.70 in the attention scale.
_V3_16B: dict[str, Any] = dict(
    _V3_671B,
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    scoring_func="softmax",
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.70,
        "mscale_all_dim": 0.70,
        "original_max_position_embeddings": 4096,
    },
    num_mtp_layers=0,
)

# Small enough for CPU tests, with every feature of the real one: query LoRA, grouped routing (4 groups, 2 kept),
# sigmoid scores with the correction bias, shared experts, a dense first layer, YaRN.
_TINY: dict[str, Any] = dict(
    _V3_671B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 256,
    },
    num_mtp_layers=0,
    bos_token_id=None,
    eos_token_id=None,
)

PRESETS: dict[str, dict[str, Any]] = {"deepseek-v3-671b": _V3_671B, "deepseek-v3-16b": _V3_16B, "tiny": _TINY}
"""Preset name -> ``DeepseekV3Config`` fields (read through :func:`get_preset_config`)."""

_CONFIG_KEYS = config_keys(DeepseekV3Config, "scoring_func", "rope_theta", "num_local_experts", "router_aux_loss_coef")


def get_preset_config(name: str, **overrides: Any) -> DeepseekV3Config:
    """A ``DeepseekV3Config`` by preset name, with fields overridden by keyword (``num_hidden_layers=4``).

    Raises:
        ValueError: unknown preset name or unknown override key.
    """
    return preset_config("DeepSeek-V3", PRESETS, DeepseekV3Config, check_config, _CONFIG_KEYS, name, overrides)


def scoring_func(config: DeepseekV3Config) -> str:
    """The router's score function: ``config.scoring_func``, ``"sigmoid"`` when the config has none."""
    return getattr(config, "scoring_func", None) or "sigmoid"


def is_moe_layer(config: DeepseekV3Config, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has routed experts: every layer from ``first_k_dense_replace`` on."""
    return layer_idx >= (config.first_k_dense_replace or 0) and config.n_routed_experts > 0


def check_config(config: DeepseekV3Config) -> None:
    """Refuse configs this model does not implement, each with the reason and the fix.

    Raises:
        ValueError: another architecture, or a feature we do not support.
    """
    check_common_config(config, MODEL_TYPE, "DeepSeek-V3")
    if scoring_func(config) not in SCORING_FUNCS:
        raise ValueError(f"scoring_func={scoring_func(config)!r} is not supported; choose one of {SCORING_FUNCS}")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported (its tables change with the sequence length); choose one of "
            f"{ROPE_TYPES}"
        )
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={config.num_key_value_heads} differs from num_attention_heads="
            f"{config.num_attention_heads}: MLA expands keys and values per head; set them equal"
        )
    if config.q_lora_rank is not None and config.q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank={config.q_lora_rank}: use null (no query LoRA) or a positive rank")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    e, g, k = config.n_routed_experts, config.n_group or 1, config.num_experts_per_tok
    if e > 0:
        if not 0 < k <= e:
            raise ValueError(f"num_experts_per_tok={k} must be in [1, n_routed_experts={e}]")
        if e % g or (g > 1 and e // g < 2):
            raise ValueError(f"n_group={g} must divide n_routed_experts={e} into groups of at least 2 experts")
        topk_group = config.topk_group or 1
        if not 0 < topk_group <= g or topk_group * (e // g) < k:
            raise ValueError(
                f"topk_group={topk_group} must be in [1, n_group={g}] and keep at least num_experts_per_tok={k} "
                f"experts ({topk_group} groups x {e // g})"
            )
