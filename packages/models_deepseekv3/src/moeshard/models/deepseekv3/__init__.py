"""moeshard.models.deepseekv3: the DeepSeek-V3 architecture (DeepSeek-V3/R1, Kimi K2, Moonlight) in plain PyTorch,
numerically equal to transformers' ``DeepseekV3ForCausalLM``.

MLA attention (optional query LoRA, YaRN RoPE), dense first layers, MoE layers with shared experts and a
group-limited router (sigmoid or softmax scores, the selection-only ``e_score_correction_bias``,
``routed_scaling_factor``), fused experts computed by ``moeshard.ep``'s dispatchers; transformers' FQNs, Hub
checkpoints in both expert layouts (FP8 block-scaled weights dequantised on load, multi-token-prediction layers
skipped), and the model's parallel plan for the shared ``parallelize``.

    from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained("/ckpt/Moonlight-16B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids, attention_mask=mask)    # .loss .logits
    model.save_pretrained("/ckpt/finetuned")                         # transformers loads it too
"""

from transformers import DeepseekV3Config as _DeepseekV3Config

from moeshard.models.common import ModelFamily as _ModelFamily
from moeshard.models.deepseekv3._layers import MLAttention
from moeshard.models.deepseekv3._model import (
    DEEPSEEK_V3_FORMAT,
    STRUCTURAL_CONFIG_KEYS,
    DeepseekV3ForCausalLM,
    DeepseekV3Model,
)
from moeshard.models.deepseekv3._moe import DeepseekV3MoE
from moeshard.models.deepseekv3._presets import MODEL_TYPE, PRESETS, check_config, get_preset_config, is_moe_layer

FAMILY = _ModelFamily(DeepseekV3ForCausalLM, PRESETS, get_preset_config)
"""DeepSeek-V3 as a :class:`moeshard.models.common.ModelFamily` (what a trainer needs, by family name)."""


def count_parameters(config: _DeepseekV3Config) -> tuple[int, int]:
    """``(total, active per token)`` parameters of the causal LM for ``config``, derived from the model built on the
    meta device (``FAMILY.count_parameters``)."""
    return FAMILY.count_parameters(config)


def flops_per_token(config: _DeepseekV3Config, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) at ``seq_len`` with causal attention, derived from the model
    (``FAMILY.flops_per_token``: 6 x its matmul parameters per token + 6 x (S/2) x heads x (q·k + value head sizes)
    per layer)."""
    return FAMILY.flops_per_token(config, seq_len)


__all__ = [
    "DEEPSEEK_V3_FORMAT",
    "FAMILY",
    "MODEL_TYPE",
    "PRESETS",
    "STRUCTURAL_CONFIG_KEYS",
    "DeepseekV3ForCausalLM",
    "DeepseekV3MoE",
    "DeepseekV3Model",
    "MLAttention",
    "check_config",
    "count_parameters",
    "flops_per_token",
    "get_preset_config",
    "is_moe_layer",
]
