"""The sparse MoE block: softmax top-k router and fused SwiGLU experts (the balancing losses: ``balancing``).

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

__all__ = ["Experts", "SparseMoeBlock", "TopKRouter", "routers"]


class TopKRouter(nn.Module):
    """Linear router: softmax over experts in float32, top-k, optional renormalisation of the k weights.

    ``bias`` (None until :meth:`enable_bias`): a float32 ``[E]`` buffer added to the probabilities for the top-k
    *selection* only; the combine weights stay the unbiased probabilities of the selected experts (aux-loss-free
    balancing, see :func:`update_router_bias`). A persistent buffer once enabled, so distributed checkpoints keep it;
    transformers' format has no place for it.
    """

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.bias: torch.Tensor | None = None

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std), as transformers initialises routers (the selection bias, if any, is left as it is)."""
        nn.init.normal_(self.weight, mean=0.0, std=std, generator=generator)

    def enable_bias(self) -> None:
        """Register ``bias`` (zeros, float32, on the router's device) if it is not there yet."""
        if self.bias is None:
            del self.bias
            self.register_buffer("bias", torch.zeros(self.weight.shape[0], device=self.weight.device))

    def select(self, probs_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_probs_TK, topk_ids_TK)``: the top-k experts by ``probs + bias``, with their unbiased probs."""
        if self.bias is None:
            return torch.topk(probs_TE, self.top_k, dim=-1)
        ids_TK = torch.topk(probs_TE + self.bias, self.top_k, dim=-1).indices
        return probs_TE.gather(-1, ids_TK), ids_TK

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits_TE, topk_weights_TK, topk_ids_TK)``; weights in the logits' dtype, as transformers."""
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_TK, ids_TK = self.select(probs_TE)
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

    def __init__(self, num_experts: int, hidden_size: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        e, f, d = num_experts, width, hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))
        self.dispatch = LocalDispatch(num_experts)

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for both fused tensors, as transformers initialises experts."""
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std, generator=generator)
        nn.init.normal_(self.down_proj, mean=0.0, std=std, generator=generator)

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
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.gate = TopKRouter(config)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y_BSD, router_logits_TE)`` with T = B·S."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE, weights_TK, ids_TK = self.gate(x_TD)
        y_TD = self.experts(x_TD, ids_TK, weights_TK)
        return y_TD.view_as(x_BSD), logits_TE


def routers(model: nn.Module) -> list[TopKRouter]:
    """The routers of ``model``'s MoE layers, in layer order (the order of ``router_logits``)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]
