"""moeshard.models.qwen3moe: Qwen3-MoE (30B-A3B) in plain PyTorch, numerically equal to transformers.

Fused experts (``mlp.experts.gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``) computed by each layer's expert
dispatcher (``moeshard.ep``), transformers' FQNs, HF safetensors load/save (both expert layouts, lazily and per
rank), the model's parallel plan, and :func:`parallelize` (EP, activation checkpointing, compile, FSDP2,
prefetch; needs the ``parallel`` extra).

    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained("/ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids, attention_mask=mask)    # .loss .aux_loss .logits
    model.save_pretrained("/ckpt/finetuned")                         # transformers loads it too
"""

from moeshard.models.common import CheckpointError, SafetensorsDir
from moeshard.models.common import ModelFamily as _ModelFamily
from moeshard.models.qwen3moe._evaluation import EvalResult, evaluate
from moeshard.models.qwen3moe._parallelize import (
    Parallelized,
    ParallelOptions,
    apply_activation_checkpointing,
    parallelize,
)
from moeshard.models.qwen3moe.balancing import (
    Balancing,
    BalancingOptions,
    GlobalExpertCounts,
    StepBalance,
    expert_counts,
    global_balancing_loss,
    load_balancing_loss,
    router_z_loss,
    update_router_bias,
)
from moeshard.models.qwen3moe.checkpoint import (
    STRUCTURAL_CONFIG_KEYS,
    LoadReport,
    load_hf_config,
    load_hf_weights,
    local_region,
)
from moeshard.models.qwen3moe.checkpoint_save import save_hf_checkpoint, save_hf_weights
from moeshard.models.qwen3moe.model import (
    IGNORE_INDEX,
    CausalLMOutput,
    DecoderLayer,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
    causal_lm_loss,
)
from moeshard.models.qwen3moe.moe import Experts, SparseMoeBlock, TopKRouter, routers
from moeshard.models.qwen3moe.presets import (
    MODEL_TYPE,
    PRESETS,
    check_config,
    count_parameters,
    flops_per_token,
    get_preset_config,
    is_moe_layer,
)

FAMILY = _ModelFamily(
    name=MODEL_TYPE,
    model_class=Qwen3MoeForCausalLM,
    presets=PRESETS,
    preset_config=get_preset_config,
    count_parameters=count_parameters,
    flops_per_token=flops_per_token,
    structural_keys=STRUCTURAL_CONFIG_KEYS,
)
"""Qwen3-MoE as a :class:`moeshard.models.common.ModelFamily` (what a trainer needs, by family name)."""

__all__ = [
    "FAMILY",
    "IGNORE_INDEX",
    "MODEL_TYPE",
    "PRESETS",
    "STRUCTURAL_CONFIG_KEYS",
    "Balancing",
    "BalancingOptions",
    "CausalLMOutput",
    "CheckpointError",
    "DecoderLayer",
    "EvalResult",
    "Experts",
    "GlobalExpertCounts",
    "LoadReport",
    "ParallelOptions",
    "Parallelized",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeModel",
    "SafetensorsDir",
    "SparseMoeBlock",
    "StepBalance",
    "TopKRouter",
    "apply_activation_checkpointing",
    "causal_lm_loss",
    "check_config",
    "count_parameters",
    "evaluate",
    "expert_counts",
    "flops_per_token",
    "get_preset_config",
    "global_balancing_loss",
    "is_moe_layer",
    "load_balancing_loss",
    "load_hf_config",
    "load_hf_weights",
    "local_region",
    "parallelize",
    "router_z_loss",
    "routers",
    "save_hf_checkpoint",
    "save_hf_weights",
    "update_router_bias",
]
