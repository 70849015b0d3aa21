"""Named GPT-OSS configurations and the checks our model makes on a config.

Configs are transformers' ``GptOssConfig``, so a ``config.json`` from the Hub reads unchanged::

    cfg = get_preset_config("gpt-oss-20b")
    cfg = get_preset_config("tiny", num_hidden_layers=2)          # tests; any field can be overridden
"""

from __future__ import annotations

from typing import Any

from transformers import GptOssConfig

from moeshard.models.common import check_common_config, config_keys, preset_config

__all__ = ["LAYER_TYPES", "MODEL_TYPE", "PRESETS", "check_config", "get_preset_config", "is_moe_layer"]

MODEL_TYPE = "gpt_oss"
"""The ``model_type`` of the configs and checkpoints this package accepts."""

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` entries: a sliding window of ``sliding_window`` keys, or every earlier key."""

_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# Values of openai/gpt-oss-20b's config.json (bf16 fields; the Hub's experts are MXFP4, dequantised on load).
_GPT_OSS_20B: dict[str, Any] = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters=_YARN,
    attention_bias=True,
    attention_dropout=0.0,
    swiglu_limit=7.0,
    router_aux_loss_coef=0.9,
    output_router_logits=False,
    tie_word_embeddings=False,
    initializer_range=0.02,
    hidden_act="silu",
    pad_token_id=199999,
    eos_token_id=200002,
)

_GPT_OSS_120B: dict[str, Any] = dict(
    _GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128, layer_types=["sliding_attention", "full_attention"] * 18
)

# Every feature of the real ones at CPU-test size: GQA, sliding (window 8) and full layers, YaRN, top-2 of 8.
_TINY: dict[str, Any] = dict(
    _GPT_OSS_20B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=1024,
    rope_parameters=dict(_YARN, original_max_position_embeddings=32),
    pad_token_id=None,
    eos_token_id=None,
)

PRESETS: dict[str, dict[str, Any]] = {"gpt-oss-20b": _GPT_OSS_20B, "gpt-oss-120b": _GPT_OSS_120B, "tiny": _TINY}
"""Preset name -> ``GptOssConfig`` fields (read through :func:`get_preset_config`)."""

_CONFIG_KEYS = config_keys(GptOssConfig, "rope_theta", "num_experts", "swiglu_alpha")


def get_preset_config(name: str, **overrides: Any) -> GptOssConfig:
    """A ``GptOssConfig`` by preset name, with fields overridden by keyword (``num_hidden_layers=4``).

    Raises:
        ValueError: unknown preset name or unknown override key.
    """
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        overrides = dict(overrides, layer_types=[LAYER_TYPES[i % 2] for i in range(n)])
    return preset_config("GPT-OSS", PRESETS, GptOssConfig, check_config, _CONFIG_KEYS, name, overrides)


def is_moe_layer(config: GptOssConfig, layer_idx: int) -> bool:
    """Every GPT-OSS layer has routed experts."""
    return True


def check_config(config: GptOssConfig) -> None:
    """Refuse configs this model does not implement, each with the reason and the fix.

    Raises:
        ValueError: another architecture, tied embeddings, inconsistent heads or layer types, a window < 1, a
            quantisation other than MXFP4.
    """
    check_common_config(config, MODEL_TYPE, "GPT-OSS")
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method not in (None, "mxfp4"):
        raise ValueError(
            f"quantization_config.quant_method={method!r}: GPT-OSS checkpoints load from bf16 or MXFP4 (mxfp4) "
            "experts; dequantise the checkpoint to bf16 first"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    types = list(config.layer_types or [])
    if len(types) != config.num_hidden_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"layer_types must name {config.num_hidden_layers} layers, each one of {LAYER_TYPES}, got {types}"
        )
    if "sliding_attention" in types and not (config.sliding_window or 0) >= 1:
        raise ValueError(f"sliding_window={config.sliding_window} must be >= 1 for sliding_attention layers")
    if not 0 < config.num_experts_per_tok <= config.num_local_experts:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} must be in [1, "
            f"num_local_experts={config.num_local_experts}]"
        )
