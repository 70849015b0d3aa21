"""DeepSeek-V3's MoE block: a router with sigmoid (or softmax) scores, a selection-only correction bias and
group-limited top-k, routed experts through the expert dispatcher, and shared experts beside them.

Parameter names and layouts are those of transformers 5.x: ``mlp.gate.weight [E, D]``,
``mlp.gate.e_score_correction_bias [E]`` (a float32 buffer, stored in Hub checkpoints), ``mlp.experts.gate_up_proj
[E, 2F, D]``, ``mlp.experts.down_proj [E, D, F]``, ``mlp.shared_experts.{gate,up,down}_proj.weight`` (one SwiGLU MLP
of width ``n_shared_experts · F``).

Legend: T tokens, K top-k, D hidden, E experts, G expert groups, F expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config

from moeshard.models.deepseekv3._presets import scoring_func
from moeshard.models.qwen3moe.layers import DenseMLP
from moeshard.models.qwen3moe.moe import Experts

__all__ = ["DeepseekV3MoE", "GroupLimitedRouter"]


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router, as transformers' ``DeepseekV3TopkRouter`` (plus softmax scoring).

    1. ``logits = x · Wᵀ`` in float32; ``scores = sigmoid(logits)`` (or ``softmax``).
    2. Selection on ``scores + e_score_correction_bias``: the experts are cut into ``n_group`` groups, each group
       scored by the sum of its two best experts, the best ``topk_group`` groups kept, and the top-k experts taken
       among those (group-limited routing; one group = plain top-k).
    3. Combine weights: the *unbiased* scores of the selected experts, renormalised to sum 1 when
       ``norm_topk_prob``, times ``routed_scaling_factor``; float32.

    The bias changes which experts are chosen, never how much they weigh (aux-loss-free balancing moves it).
    """

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group, self.topk_group = config.n_group or 1, config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.scoring_func = scoring_func(config)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for the weight and a zero bias, as transformers initialises the router."""
        nn.init.normal_(self.weight, mean=0.0, std=std, generator=generator)
        self.e_score_correction_bias.zero_()

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``sigmoid`` or ``softmax`` of the float32 logits."""
        if self.scoring_func == "sigmoid":
            return logits_TE.sigmoid()
        return logits_TE.softmax(dim=-1)

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """``ids_TK``: the group-limited top-k by ``scores + e_score_correction_bias``."""
        choice_TE = scores_TE + self.e_score_correction_bias
        if self.n_group > 1:
            t, g = choice_TE.shape[0], self.n_group
            group_TG = choice_TE.view(t, g, -1).topk(2, dim=-1)[0].sum(dim=-1)
            keep_TG = torch.zeros_like(group_TG).scatter_(1, group_TG.topk(self.topk_group, dim=-1)[1], 1.0)
            keep_TE = keep_TG.unsqueeze(-1).expand(t, g, self.num_experts // g).reshape(t, -1)
            choice_TE = choice_TE.masked_fill(~keep_TE.bool(), float("-inf"))
        return torch.topk(choice_TE, self.top_k, dim=-1, sorted=False)[1]

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits_TE, topk_weights_TK, topk_ids_TK)``, logits and weights in float32."""
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = self.scores(logits_TE)
        ids_TK = self.select(scores_TE)
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return logits_TE, weights_TK * self.routed_scaling_factor, ids_TK

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, groups={self.topk_group}/{self.n_group}, "
            f"score={self.scoring_func}, scale={self.routed_scaling_factor}"
        )


class DeepseekV3MoE(nn.Module):
    """Routed experts (sharded by EP like any others) plus the shared experts, which every token goes through
    (a plain MLP: an ordinary part of the decoder layer's FSDP unit)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        # Same registration order as transformers (experts, gate, shared_experts), so state_dict orders match.
        self.experts = Experts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.gate = GroupLimitedRouter(config)
        self.shared_experts = DenseMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y_BSD, router_logits_TE)`` with T = B·S."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE, weights_TK, ids_TK = self.gate(x_TD)
        y_TD = self.experts(x_TD, ids_TK, weights_TK)
        return y_TD.view_as(x_BSD) + self.shared_experts(x_BSD), logits_TE
