"""Qwen3-MoE's sparse MoE block: a softmax top-k router and fused SwiGLU experts, no shared experts."""

from __future__ import annotations

from transformers import Qwen3MoeConfig

from moeshard.models.common import Experts, MoEBlock, TopKRouter

__all__ = ["SparseMoeBlock"]


class SparseMoeBlock(MoEBlock):
    """Router + routed experts (no shared expert in Qwen3-MoE), from the config."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__(
            Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size),
            TopKRouter(config.num_experts, config.hidden_size, config.num_experts_per_tok, config.norm_topk_prob),
        )
