"""DeepSeek-V3's MoE block: the group-limited router, routed experts, and shared experts beside them."""

from __future__ import annotations

from transformers import DeepseekV3Config

from moeshard.models.common import DenseMLP, Experts, GroupLimitedRouter, MoEBlock
from moeshard.models.deepseekv3._presets import scoring_func

__all__ = ["DeepseekV3MoE"]


class DeepseekV3MoE(MoEBlock):
    """``mlp.experts`` (sharded by EP like any others), ``mlp.gate`` (a :class:`GroupLimitedRouter`: sigmoid or
    softmax scores, the correction bias, ``n_group``/``topk_group``, ``routed_scaling_factor``) and
    ``mlp.shared_experts`` (one SwiGLU MLP of width ``n_shared_experts · moe_intermediate_size``), from the config."""

    def __init__(self, config: DeepseekV3Config) -> None:
        gate = GroupLimitedRouter(
            config.n_routed_experts,
            config.hidden_size,
            config.num_experts_per_tok,
            n_group=config.n_group or 1,
            topk_group=config.topk_group or 1,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=config.routed_scaling_factor,
            scoring_func=scoring_func(config),
        )
        shared = None
        if config.n_shared_experts:
            shared = DenseMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
        super().__init__(
            Experts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size), gate, shared
        )
