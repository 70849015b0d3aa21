"""moeshard.models.qwen3moe: Qwen3-MoE (30B-A3B) in plain PyTorch, numerically equal to transformers.

Qwen3-MoE's model, MoE block, presets and checkpoint format (:data:`FAMILY` holds them as one value); the rest (the
causal LM, fused experts through ``moeshard.ep``'s dispatchers, HF safetensors load/save, ``parallelize``,
balancing) is ``moeshard.models.common``'s, imported from there.

    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained("/ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids, attention_mask=mask)    # .loss .aux_loss .logits
    model.save_pretrained("/ckpt/finetuned")                         # transformers loads it too
"""

from transformers import Qwen3MoeConfig as _Qwen3MoeConfig

from moeshard.models.common import ModelFamily as _ModelFamily
from moeshard.models.qwen3moe._checkpoint import QWEN3_FORMAT, STRUCTURAL_CONFIG_KEYS, load_hf_config
from moeshard.models.qwen3moe._checkpoint_save import save_hf_weights
from moeshard.models.qwen3moe._model import Qwen3MoeForCausalLM, Qwen3MoeModel
from moeshard.models.qwen3moe._moe import SparseMoeBlock
from moeshard.models.qwen3moe._presets import (
    MODEL_TYPE,
    PRESETS,
    check_config,
    get_preset_config,
    is_moe_layer,
)

FAMILY = _ModelFamily(Qwen3MoeForCausalLM, PRESETS, get_preset_config)
"""Qwen3-MoE as a :class:`moeshard.models.common.ModelFamily` (what a trainer needs, by family name)."""


def count_parameters(config: _Qwen3MoeConfig) -> tuple[int, int]:
    """``(total, active per token)`` parameters of the causal LM for ``config``, derived from the model built on the
    meta device (``FAMILY.count_parameters``)."""
    return FAMILY.count_parameters(config)


def flops_per_token(config: _Qwen3MoeConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) at ``seq_len`` with causal attention, derived from the model
    (``FAMILY.flops_per_token``: 6 x its matmul parameters per token + 6 x (S/2) x heads x (q·k + value head sizes)
    per layer)."""
    return FAMILY.flops_per_token(config, seq_len)


__all__ = [
    "FAMILY",
    "MODEL_TYPE",
    "PRESETS",
    "QWEN3_FORMAT",
    "STRUCTURAL_CONFIG_KEYS",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
    "SparseMoeBlock",
    "check_config",
    "count_parameters",
    "flops_per_token",
    "get_preset_config",
    "is_moe_layer",
    "load_hf_config",
    "save_hf_weights",
]
