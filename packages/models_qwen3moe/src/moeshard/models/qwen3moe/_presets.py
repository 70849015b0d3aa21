"""Named Qwen3-MoE configurations, the checks our model makes on a config, and which layers have experts.

Configs are transformers' ``Qwen3MoeConfig``, so a ``config.json`` from the Hub reads unchanged::

    cfg = get_preset_config("qwen3-30b-a3b")                      # the real 30B-A3B
    cfg = get_preset_config("qwen3-235b-a22b")                    # the real 235B-A22B
    cfg = get_preset_config("tiny", num_hidden_layers=2)          # tests; any field can be overridden

Parameter and FLOP counts are derived from the model (``FAMILY.count_parameters``, ``FAMILY.facts``), not written.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3MoeConfig

from moeshard.models.common import check_common_config, config_keys, preset_config

__all__ = [
    "MODEL_TYPE",
    "PRESETS",
    "check_config",
    "get_preset_config",
    "is_moe_layer",
]

MODEL_TYPE = "qwen3_moe"
"""The ``model_type`` of the configs and checkpoints this package accepts."""

# Values of Qwen/Qwen3-30B-A3B's config.json (head_dim is 128 although hidden / heads = 64).
_QWEN3_30B_A3B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=40960,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    attention_bias=False,
    use_sliding_window=False,
    attention_dropout=0.0,
    decoder_sparse_step=1,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    mlp_only_layers=[],
    bos_token_id=151643,
    eos_token_id=151645,
)

# Values of Qwen/Qwen3-235B-A22B's config.json: the same architecture, wider and deeper (head_dim 128 although
# hidden / heads = 64).
_QWEN3_235B_A22B: dict[str, Any] = dict(
    _QWEN3_30B_A3B,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=94,
    num_attention_heads=64,
    num_key_value_heads=4,
    moe_intermediate_size=1536,
)

# Small enough for CPU tests in milliseconds, with every feature of the real one (GQA, q/k norm, top-k > 1).
_TINY: dict[str, Any] = dict(
    _QWEN3_30B_A3B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    bos_token_id=None,
    eos_token_id=None,
)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-235b-a22b": _QWEN3_235B_A22B,
    "tiny": _TINY,
}
"""Preset name -> ``Qwen3MoeConfig`` fields (read through :func:`get_preset_config`)."""

# Keys a Qwen3MoeConfig understands: its dataclass fields plus the ones it reads through kwargs.
_CONFIG_KEYS = config_keys(Qwen3MoeConfig, "head_dim", "rope_theta", "num_local_experts", "max_window_layers")


def get_preset_config(name: str, **overrides: Any) -> Qwen3MoeConfig:
    """A ``Qwen3MoeConfig`` by preset name, with fields overridden by keyword (``num_hidden_layers=4``).

    Raises:
        ValueError: unknown preset name or unknown override key.
    """
    return preset_config("Qwen3-MoE", PRESETS, Qwen3MoeConfig, check_config, _CONFIG_KEYS, name, overrides)


def head_dim(config: Qwen3MoeConfig) -> int:
    """Per-head width: ``config.head_dim`` when set, else ``hidden_size // num_attention_heads`` (as transformers)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def is_moe_layer(config: Qwen3MoeConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has routed experts (else a dense MLP), exactly as transformers decides."""
    mlp_only = config.mlp_only_layers or []
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0


def check_config(config: Qwen3MoeConfig) -> None:
    """Refuse configs this model does not implement, each with the reason and the fix.

    Raises:
        ValueError: another architecture, or a feature we do not support (sliding window, tied embeddings,
            activation other than SiLU, RoPE scaling, inconsistent head counts).
    """
    check_common_config(config, MODEL_TYPE, "Qwen3-MoE")
    if config.use_sliding_window:
        raise ValueError("use_sliding_window=True is not supported (Qwen3-MoE does not use it); set it to False")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={rope.get('rope_type')!r} is not supported, only 'default' RoPE; "
            "remove rope scaling from the config"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={config.num_key_value_heads}"
        )
    if config.num_experts > 0 and not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"num_experts_per_tok={config.num_experts_per_tok} must be in [1, num_experts={config.num_experts}]"
        )
    if config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={config.decoder_sparse_step} must be >= 1")
