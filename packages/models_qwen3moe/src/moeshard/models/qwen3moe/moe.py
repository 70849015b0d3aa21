"""The sparse MoE block: softmax top-k router, fused SwiGLU experts, and the load-balancing loss.

Parameter names and layouts are those of transformers 5.x, so FQNs and checkpoints match:
``mlp.gate.weight [E, D]``, ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and
``mlp.experts.down_proj [E, D, F]``. The routed computation itself (and, under EP, the token all-to-all) is the
experts' dispatcher (``Experts.dispatch``, a ``moeshard.ep`` dispatcher); this file only routes.

Legend: T tokens, K top-k, D hidden, E experts (local to this EP rank in parameter shapes), F expert width.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3MoeConfig

from moeshard.ep import LocalDispatch

__all__ = [
    "Experts",
    "GlobalExpertCounts",
    "SparseMoeBlock",
    "TopKRouter",
    "expert_counts",
    "global_balancing_loss",
    "load_balancing_loss",
    "router_z_loss",
    "routers",
    "update_router_bias",
]


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


# ---- balancing over a global batch, aux-loss-free balancing, z-loss --------------------------------------------------


def routers(model: nn.Module) -> list[TopKRouter]:
    """The routers of ``model``'s MoE layers, in layer order (the order of ``router_logits``)."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@torch.no_grad()
def expert_counts(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    top_k: int,
    biases: list[torch.Tensor | None] | None = None,
    attention_mask_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens routed to each expert of each MoE layer: float32 ``[L, E]`` (each token counts once per selected
    expert; padding left out when ``attention_mask_BS`` is given). The same selection as the routers' (``biases``:
    each router's ``bias``, see :func:`routers`). No host sync: sum it over micro-batches and all-reduce it over
    ranks for the global load of a step."""
    rows = []
    for i, logits_TE in enumerate(router_logits):
        probs_TE = torch.softmax(logits_TE.detach(), dim=-1, dtype=torch.float32)
        bias = biases[i] if biases is not None else None
        ids_TK = torch.topk(probs_TE if bias is None else probs_TE + bias, top_k, dim=-1).indices
        weight_TK = torch.ones_like(ids_TK, dtype=torch.float32)
        if attention_mask_BS is not None:
            weight_TK = weight_TK * attention_mask_BS.reshape(-1, 1).to(weight_TK)
        rows.append(
            torch.zeros(logits_TE.shape[-1], device=logits_TE.device).scatter_add_(
                0, ids_TK.flatten(), weight_TK.flatten()
            )
        )
    return torch.stack(rows)


def global_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    counts_LE: torch.Tensor,
    top_k: int,
    attention_mask_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Load-balancing loss with the expert frequencies of a larger batch: ``mean_l E · Σ_e f_le · P_le``.

    ``f_le``: the fraction of layer ``l``'s tokens routed to expert ``e`` according to ``counts_LE`` (e.g. the step's
    counts over all micro-batches so far and all ranks, from :func:`expert_counts` all-reduced: no gradient; the
    ``f`` of a layer sum to ``top_k``, as in transformers' loss, so the same coefficient applies); ``P_le``: the
    mean router probability of expert ``e`` over this call's tokens (the gradient flows through it). With this
    call's own counts it is transformers' loss computed per layer and averaged over layers.
    """
    f_LE = counts_LE * top_k / counts_LE.sum(-1, keepdim=True).clamp_min(1.0)
    p_rows = []
    mask_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1, 1).float()
    for logits_TE in router_logits:
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if mask_T is None:
            p_rows.append(probs_TE.mean(0))
        else:
            m = mask_T.to(probs_TE.device)
            p_rows.append((probs_TE * m).sum(0) / m.sum().clamp_min(1.0))
    p_LE = torch.stack(p_rows)
    return counts_LE.shape[-1] * (f_LE.to(p_LE.device) * p_LE).sum(-1).mean()


def router_z_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], attention_mask_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens and MoE layers of ``logsumexp(logits)²`` (float32)."""
    mask_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1).float()
    total = []
    for logits_TE in router_logits:
        z_T = torch.logsumexp(logits_TE.float(), dim=-1).square()
        if mask_T is None:
            total.append(z_T.mean())
        else:
            m = mask_T.to(z_T.device)
            total.append((z_T * m).sum() / m.sum().clamp_min(1.0))
    return torch.stack(total).mean()


@torch.no_grad()
def update_router_bias(model: nn.Module, load_LE: torch.Tensor, update_rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): after an optimizer step, move each router's selection bias by
    ``update_rate`` towards balance, ``bias_e += rate · sign(mean load - load_e)``: under-loaded experts up,
    over-loaded down. ``load_LE``: the step's global expert counts (identical on every rank, so are the biases)."""
    rs = routers(model)
    if len(rs) != load_LE.shape[0]:
        raise ValueError(f"load has {load_LE.shape[0]} layers but the model has {len(rs)} MoE layers")
    for router, load_E in zip(rs, load_LE):
        if router.bias is None:
            raise ValueError("the routers have no bias: call model.enable_router_bias() before training")
        load_E = load_E.to(router.bias.device, torch.float32)
        router.bias.add_(update_rate * torch.sign(load_E.mean() - load_E))


class GlobalExpertCounts:
    """A step's expert counts summed over its micro-batches and over the ranks of ``group``, on the device.

    The counts are :func:`expert_counts`' ``[L, E]`` float32, added micro-batch by micro-batch (no host sync).

    - Global-batch balancing loss: ``add(counts, all_reduce=True)`` all-reduces each micro-batch's counts at once
      (one all-reduce of ``[L, E]``) and returns the running sum: micro-batch ``m`` of a step sees the counts of
      micro-batches ``1..m`` of that step on every rank. Pass it to :func:`global_balancing_loss`. This is the
      running form of a global-batch loss (Megatron-LM's ``global_aux_loss`` keeps the same running sum): the
      last micro-batch sees the whole step's counts, the first only its own micro-batch on all ranks.
    - Otherwise ``add(counts)`` keeps them on this rank, and :meth:`total` all-reduces them once per step.

    :meth:`total` gives the step's global counts, identical on every rank (for the load metrics and
    :func:`update_router_bias`); :meth:`reset` starts the next step. Without a process group nothing is
    communicated (one rank's counts are the global ones).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._reduced_LE: torch.Tensor | None = None  # summed over the ranks already
        self._local_LE: torch.Tensor | None = None  # this rank's, not yet reduced

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def reset(self) -> None:
        """Forget the counts (a new step)."""
        self._reduced_LE = self._local_LE = None

    def add(self, counts_LE: torch.Tensor, *, all_reduce: bool = False) -> torch.Tensor:
        """Add one micro-batch's counts of this rank.

        Args:
            all_reduce: sum them over the ranks now (every rank must call it alike, once per micro-batch).

        Returns:
            With ``all_reduce``, the running global counts of the step's micro-batches so far (all ranks); else this
            rank's counts so far plus what was reduced already.
        """
        counts_LE = counts_LE.detach().float()
        if all_reduce:
            reduced = self._all_reduce(counts_LE.clone())
            self._reduced_LE = reduced if self._reduced_LE is None else self._reduced_LE + reduced
            return self._reduced_LE if self._local_LE is None else self._reduced_LE + self._local_LE
        self._local_LE = counts_LE.clone() if self._local_LE is None else self._local_LE + counts_LE
        return self._local_LE if self._reduced_LE is None else self._reduced_LE + self._local_LE

    def total(self) -> torch.Tensor | None:
        """The step's counts over all micro-batches and ranks (one all-reduce of the local part, if any; every rank
        must call it alike), or None when nothing was added."""
        if self._local_LE is not None:
            local = self._all_reduce(self._local_LE)
            self._reduced_LE = local if self._reduced_LE is None else self._reduced_LE + local
            self._local_LE = None
        return self._reduced_LE
