"""The sparse MoE block: softmax top-k router, fused SwiGLU experts, and the load-balancing loss.

Parameter names and layouts are those of transformers 5.x, so FQNs and checkpoints match:
``mlp.gate.weight [E, D]``, ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and
``mlp.experts.down_proj [E, D, F]``. The routed computation itself (and, under EP, the token all-to-all) is the
experts' dispatcher (``Experts.dispatch``, a ``moeshard.ep`` dispatcher); this file only routes.

Legend: T tokens, K top-k, D hidden, E experts (local to this EP rank in parameter shapes), F expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig

from moeshard.ep import LocalDispatch

__all__ = ["Experts", "SparseMoeBlock", "TopKRouter", "load_balancing_loss"]


class TopKRouter(nn.Module):
    """Linear router: softmax over experts in float32, top-k, optional renormalisation of the k weights."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits_TE, topk_weights_TK, topk_ids_TK)``; weights in the logits' dtype, as transformers."""
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, ids_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        return logits_TE, weights_TK.to(logits_TE.dtype), ids_TK


class Experts(nn.Module):
    """All experts of one layer as two fused tensors; the EP plan shards both on dim 0.

    The routed computation is ``self.dispatch`` (a plain attribute, not a submodule): a
    ``moeshard.ep.LocalDispatch`` over all experts until ``moeshard.ep.apply_ep`` slices the tensors to this EP
    rank's experts and installs the dispatcher of its EP group and options. ``num_experts`` stays the global
    count. A model loaded with ``expert_range`` holds some experts only and runs after ``apply_ep`` (the local
    dispatcher refuses weights that hold fewer than ``num_experts`` experts).
    """

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.dispatch = LocalDispatch(config.num_experts)

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """``y_TD``: each token's routed experts' outputs, weighted by ``topk_weights_TK`` (in float32)."""
        return self.dispatch(x_TD, topk_ids_TK, topk_weights_TK, self.gate_up_proj, self.down_proj)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, local={tuple(self.gate_up_proj.shape[:1])}"


class SparseMoeBlock(nn.Module):
    """Router + routed experts (no shared expert in Qwen3-MoE)."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        # Same registration order as transformers (experts, then gate), so state_dict orders match.
        self.experts = Experts(config)
        self.gate = TopKRouter(config)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y_BSD, router_logits_TE)`` with T = B·S."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE, weights_TK, ids_TK = self.gate(x_TD)
        y_TD = self.experts(x_TD, ids_TK, weights_TK)
        return y_TD.view_as(x_BSD), logits_TE


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all MoE layers, as transformers' ``load_balancing_loss_func``.

    ``E · Σ_e f_e · P_e`` where ``f_e`` is the share of top-k assignments to expert e and ``P_e`` its mean router
    probability, both averaged over every MoE layer's tokens (padding excluded when ``attention_mask_BS`` is
    given). Not multiplied by ``router_aux_loss_coef``.

    Args:
        router_logits: one ``[B·S, E]`` tensor per MoE layer.
        num_experts: E (global).
        top_k: experts per token.
        attention_mask_BS: 1 for tokens, 0 for padding, or None.
    """
    device = router_logits[0].device if router_logits else torch.device("cpu")
    tokens_per_expert_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_per_expert_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1).to(device, torch.float32)
    for logits_TE in router_logits:
        # Softmax in the logits' dtype (not forced to float32) to match transformers in bf16 too.
        probs_TE = torch.softmax(logits_TE, dim=-1)
        _, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
        weight_T = torch.ones(ids_TK.shape[0], dtype=torch.float32, device=device) if mask_T is None else mask_T
        tokens_per_expert_E = tokens_per_expert_E.scatter_add(0, ids_TK.reshape(-1), weight_T.repeat_interleave(top_k))
        prob_per_expert_E = prob_per_expert_E + (probs_TE.float() * weight_T[:, None]).sum(dim=0)
        rows = rows + weight_T.sum()
    return num_experts * torch.sum((tokens_per_expert_E / rows) * (prob_per_expert_E / rows))
