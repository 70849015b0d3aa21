"""moeshard.models.gptoss: GPT-OSS (20B, 120B) in plain PyTorch, numerically equal to transformers'
``GptOssForCausalLM``.

Attention with a learned sink logit per head, sliding-window (``sliding_window``) and full layers by
``layer_types``, YaRN RoPE, biased q/k/v/o; a biased linear router (softmax over the top-k logits); experts with
biases and the clamped SwiGLU (``moeshard.ep.ClampedSwiGLU``) through ``moeshard.ep``'s dispatchers; the EP plan
(biases sharded with their experts); Hub checkpoints in MXFP4 or bf16, written back as bf16.

    from moeshard.models.gptoss import GptOssForCausalLM

    model = GptOssForCausalLM.from_pretrained("/ckpt/gpt-oss-20b", dtype=torch.bfloat16)   # MXFP4 dequantised
    out = model(input_ids, labels=input_ids, attention_mask=mask)    # .loss .logits
    model.save_pretrained("/ckpt/finetuned")                         # bf16; transformers loads it too
"""

from transformers import GptOssConfig as _GptOssConfig

from moeshard.models.common import ModelFamily as _ModelFamily
from moeshard.models.gptoss._layers import GptOssAttention, sink_attention, sliding_masks
from moeshard.models.gptoss._model import GPT_OSS_FORMAT, STRUCTURAL_CONFIG_KEYS, GptOssForCausalLM, GptOssModel
from moeshard.models.gptoss._moe import GptOssExperts, GptOssMoE, GptOssRouter
from moeshard.models.gptoss._presets import (
    LAYER_TYPES,
    MODEL_TYPE,
    PRESETS,
    check_config,
    get_preset_config,
    is_moe_layer,
)

FAMILY = _ModelFamily(GptOssForCausalLM, PRESETS, get_preset_config)
"""GPT-OSS as a :class:`moeshard.models.common.ModelFamily` (what a trainer needs, by family name)."""


def count_parameters(config: _GptOssConfig) -> tuple[int, int]:
    """``(total, active per token)`` parameters of the causal LM for ``config``, derived from the model built on the
    meta device (``FAMILY.count_parameters``)."""
    return FAMILY.count_parameters(config)


__all__ = [
    "FAMILY",
    "GPT_OSS_FORMAT",
    "LAYER_TYPES",
    "MODEL_TYPE",
    "PRESETS",
    "STRUCTURAL_CONFIG_KEYS",
    "GptOssAttention",
    "GptOssExperts",
    "GptOssForCausalLM",
    "GptOssMoE",
    "GptOssModel",
    "GptOssRouter",
    "check_config",
    "count_parameters",
    "get_preset_config",
    "is_moe_layer",
    "sink_attention",
    "sliding_masks",
]
