"""moeshard.models.qwen35moe: Qwen3.5-MoE (35B-A3B; the Qwen3-Next architecture) in plain PyTorch, numerically
equal to transformers' ``Qwen3_5MoeForCausalLM``.

Three of every four layers are Gated DeltaNet linear attention (a short causal convolution, the gated delta rule's
recurrent state, a gated RMSNorm, an output gate), the others gated full attention (q/k norm, an output gate,
partial rotary); every layer has routed experts computed by ``moeshard.ep``'s dispatchers plus a sigmoid-gated
shared expert. Hub folders of the text model and of the vision-language model load (the language model is read);
``save_pretrained`` writes a text-model folder transformers loads. Parallelism is the shared ``parallelize``.

    from moeshard.models.qwen35moe import Qwen35MoeForCausalLM

    model = Qwen35MoeForCausalLM.from_pretrained("/ckpt/Qwen3.5-35B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids, document_ids=docs, position_ids=pos)   # .loss .logits
    model.save_pretrained("/ckpt/finetuned")                                          # transformers loads it
"""

from transformers import Qwen3_5MoeTextConfig as _Qwen3_5MoeTextConfig

from moeshard.models.common import ModelFamily as _ModelFamily
from moeshard.models.qwen35moe._layers import GatedAttention, GatedDeltaNet, GatedRMSNorm
from moeshard.models.qwen35moe._model import (
    QWEN35_FORMAT,
    STRUCTURAL_CONFIG_KEYS,
    Qwen35MoeForCausalLM,
    Qwen35MoeModel,
    Qwen35MoeSparseMoeBlock,
)
from moeshard.models.qwen35moe._presets import (
    LAYER_TYPES,
    MODEL_TYPE,
    PRESETS,
    VL_MODEL_TYPE,
    check_config,
    get_preset_config,
    is_moe_layer,
)

FAMILY = _ModelFamily(Qwen35MoeForCausalLM, PRESETS, get_preset_config)
"""Qwen3.5-MoE as a :class:`moeshard.models.common.ModelFamily` (what a trainer needs, by family name)."""


def count_parameters(config: _Qwen3_5MoeTextConfig) -> tuple[int, int]:
    """``(total, active per token)`` parameters of the causal LM for ``config``, derived from the model built on the
    meta device (``FAMILY.count_parameters``)."""
    return FAMILY.count_parameters(config)


def flops_per_token(config: _Qwen3_5MoeTextConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) at ``seq_len``, derived from the model
    (``FAMILY.flops_per_token``: 6 x its matmul parameters per token + 6 x (S/2) x heads x (q·k + value head sizes)
    per attention layer + 3 x the chunked gated delta rule's forward FLOPs per DeltaNet layer)."""
    return FAMILY.flops_per_token(config, seq_len)


__all__ = [
    "FAMILY",
    "LAYER_TYPES",
    "MODEL_TYPE",
    "PRESETS",
    "QWEN35_FORMAT",
    "STRUCTURAL_CONFIG_KEYS",
    "VL_MODEL_TYPE",
    "GatedAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "Qwen35MoeForCausalLM",
    "Qwen35MoeModel",
    "Qwen35MoeSparseMoeBlock",
    "check_config",
    "count_parameters",
    "flops_per_token",
    "get_preset_config",
    "is_moe_layer",
]
