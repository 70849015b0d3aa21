"""The MoE block and its parts: routers (softmax top-k; group-limited sigmoid/softmax with a correction bias), fused
SwiGLU experts, shared experts beside them (the balancing losses: ``_balancing``).

Parameter names and layouts are those of transformers 5.x, so FQNs and checkpoints match:
``mlp.gate.weight [E, D]``, ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows, then up rows),
``mlp.experts.down_proj [E, D, F]``, ``mlp.shared_experts.{gate,up,down}_proj.weight``, and DeepSeek-V3's
``mlp.gate.e_score_correction_bias [E]``. The routed computation itself (and, under EP, the token all-to-all) is the
experts' dispatcher (``Experts.dispatch``, a ``moeshard.ep`` dispatcher); this file only routes.

Legend: T tokens, K top-k, D hidden, E experts (local to this EP rank in parameter shapes), G expert groups, F expert
width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeshard.ep import LocalDispatch, LowRankDelta
from moeshard.models.common._kept import kept_topk
from moeshard.models.common._topk import TopkIds, row_topk

__all__ = [
    "SCORING_FUNCS",
    "Experts",
    "GroupLimitedRouter",
    "MoEBlock",
    "Router",
    "TopKRouter",
    "TopkSelection",
    "routers",
]

SCORING_FUNCS = ("sigmoid", "softmax")
"""Score functions of :class:`GroupLimitedRouter`."""


class Router(nn.Module):
    """What every router is: ``forward(x_TD) -> (logits_TE, topk_weights_TK, topk_ids_TK)``, a ``weight [E, D]``,
    a selection-only bias for aux-loss-free balancing (``selection_bias``, None where it has none), and its
    selection (``select_ids``) and normalised affinities (``affinities``) as functions of the logits."""

    weight: nn.Parameter
    top_k: int
    """Experts each token is routed to (what ``model_facts`` counts as active)."""

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """The float32 ``[E]`` bias added to the scores for the top-k selection only, or None."""
        raise NotImplementedError

    def enable_bias(self) -> None:
        """Give the router a selection bias (zeros) if it has none."""
        raise NotImplementedError

    @torch.no_grad()
    def select_ids(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``ids_TK``: the experts ``forward`` selects for these logits (its scores, bias and groups), no gradient."""
        raise NotImplementedError

    def affinities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, E]``: each token's affinity to each expert, normalised to sum 1 over the experts, with the
        gradient w.r.t. the logits (DeepSeek-V3's ``s'``, what the sequence-wise balance loss averages)."""
        raise NotImplementedError

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for the weight, as transformers initialises routers (the bias is left as it is)."""
        nn.init.normal_(self.weight, mean=0.0, std=std, generator=generator)


@dataclass(frozen=True)
class TopkSelection:
    """How a :class:`TopKRouter` selects its top-k, beside what it selects.

    Attributes:
        kernel: the selection's Triton kernel (``moeshard.models.common._topk_triton``'s ``topk_ids_op``), which
            ``parallelize`` gives with the ``"triton"`` kernel tier on a machine with CUDA; None: ``torch.topk``.
        kept: the router runs inside a checkpointed layer that keeps (``apply_activation_checkpointing(
            keep_attention=True)``): the top-k goes through ``kept_topk`` and the recompute replays the forward's.

    Replaced whole with :meth:`replace`, which gives one object per value: every router's compiled attention half
    then reads the same constant.
    """

    kernel: TopkIds | None = None
    kept: bool = False

    def replace(self, **changes) -> TopkSelection:
        """``dataclasses.replace(self, **changes)``, the same object for the same values."""
        value = dataclasses.replace(self, **changes)
        return _SELECTIONS.setdefault(value, value)


_SELECTIONS: dict[TopkSelection, TopkSelection] = {}


class TopKRouter(Router):
    """Linear router: softmax over experts in float32, top-k, optional renormalisation of the k weights (Qwen3-MoE).

    ``bias`` (None until :meth:`enable_bias`): a float32 ``[E]`` buffer added to the probabilities for the top-k
    *selection* only; the combine weights stay the unbiased probabilities of the selected experts (aux-loss-free
    balancing, see :func:`update_router_bias`). A persistent buffer once enabled, so distributed checkpoints keep it;
    transformers' Qwen3-MoE format has no place for it.

    ``selection`` (a :class:`TopkSelection`, the defaults until ``parallelize`` or
    ``apply_activation_checkpointing`` replaces it whole) says how the top-k is computed; the ids are the same.
    """

    selection: TopkSelection = TopkSelection().replace()  # the defaults' one object

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias: torch.Tensor | None = None

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """``bias``."""
        return self.bias

    def enable_bias(self) -> None:
        """Register ``bias`` (zeros, float32, on the router's device) if it is not there yet."""
        if self.bias is None:
            del self.bias
            self.register_buffer("bias", torch.zeros(self.weight.shape[0], device=self.weight.device))

    def select(self, probs_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_probs_TK, topk_ids_TK)``: the top-k experts by ``probs + bias``, with their unbiased probs."""
        if self.bias is None:
            return self._topk(probs_TE)
        ids_TK = self._topk(probs_TE + self.bias)[1]
        return probs_TE.gather(-1, ids_TK), ids_TK

    def _topk(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        selection = self.selection
        if selection.kept:  # inside a checkpointed layer that keeps it: the recompute replays the forward's
            return kept_topk(scores_TE, self.top_k, by_kernel=selection.kernel is not None)
        return row_topk(scores_TE, self.top_k, selection.kernel)

    @torch.no_grad()
    def select_ids(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``ids_TK`` of :meth:`select` on the float32 softmax of ``logits_TE``."""
        return self.select(torch.softmax(logits_TE.detach(), dim=-1, dtype=torch.float32))[1]

    def affinities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The float32 softmax probabilities (normalised already; the bias plays no part)."""
        return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)

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
        deltas = (self._low_rank("gate_up_proj"), self._low_rank("down_proj"))
        return self.dispatch(x_TD, topk_ids_TK, topk_weights_TK, self.gate_up_proj, self.down_proj, deltas=deltas)

    def _low_rank(self, name: str) -> LowRankDelta | None:
        """The adapter of the fused tensor ``name`` as the dispatcher takes it, or None: ``moeshard.lora`` adds
        ``<name>_lora_A [E, r, in]`` and ``<name>_lora_B [E, out, r]`` beside it and sets ``lora_scaling``. Looked up
        at each call, since FSDP swaps the parameter objects between their sharded and unsharded forms."""
        A = getattr(self, f"{name}_lora_A", None)
        if A is None:
            return None
        return LowRankDelta(A, getattr(self, f"{name}_lora_B"), self.lora_scaling)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, local={tuple(self.gate_up_proj.shape[:1])}"


class GroupLimitedRouter(Router):
    """DeepSeek-V3's router, as transformers' ``DeepseekV3TopkRouter`` (plus softmax scoring, DeepSeek-V2's).

    1. ``logits = x · Wᵀ`` in float32; ``scores = sigmoid(logits)`` (or ``softmax``).
    2. Selection on ``scores + e_score_correction_bias``: the experts are cut into ``n_group`` groups, each group
       scored by the sum of its two best experts, the best ``topk_group`` groups kept, and the top-k experts taken
       among those (group-limited routing; one group = plain top-k).
    3. Combine weights: the *unbiased* scores of the selected experts, renormalised to sum 1 when
       ``norm_topk_prob``, times ``routed_scaling_factor``; float32.

    The bias changes which experts are chosen, never how much they weigh (aux-loss-free balancing moves it).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        scoring_func: str = "sigmoid",
    ) -> None:
        super().__init__()
        if scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={scoring_func!r} is not one of {SCORING_FUNCS}")
        self.top_k, self.num_experts = top_k, num_experts
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.scoring_func = scoring_func
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    @property
    def selection_bias(self) -> torch.Tensor:
        """``e_score_correction_bias`` (always there: the Hub format stores it)."""
        return self.e_score_correction_bias

    def enable_bias(self) -> None:
        """Nothing to do: the correction bias is always there."""

    @torch.no_grad()
    def select_ids(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``ids_TK`` of :meth:`select` on the scores of the float32 logits."""
        return self.select(self.scores(logits_TE.detach().float()))

    def affinities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The scores of the float32 logits divided by their sum over the experts (sigmoid scores do not sum to 1;
        softmax ones do already); the correction bias plays no part."""
        scores_TE = self.scores(logits_TE.float())
        if self.scoring_func == "softmax":
            return scores_TE
        return scores_TE / scores_TE.sum(dim=-1, keepdim=True)

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


class MoEBlock(nn.Module):
    """A router, routed experts and, where the family has them, shared experts every token goes through (a plain
    MLP: an ordinary part of the decoder layer's FSDP unit). Registered in transformers' order (experts, gate,
    shared_experts), so state_dict orders match.

    ``shared_name``: the shared experts' name in checkpoints (``"shared_experts"``; Qwen's ``"shared_expert"``).
    ``shared_gate``: a gated shared expert (e.g. ``nn.Linear(D, 1)``, registered as ``{shared_name}_gate``) whose
    output is scaled per token by ``sigmoid(shared_gate(x))`` before it is added.
    """

    def __init__(
        self,
        experts: Experts,
        gate: Router,
        shared_experts: nn.Module | None = None,
        *,
        shared_name: str = "shared_experts",
        shared_gate: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if shared_gate is not None and shared_experts is None:
            raise ValueError("a shared expert gate needs shared experts: pass shared_experts too")
        self.experts = experts
        self.gate = gate
        self.shared_name = shared_name if shared_experts is not None else None
        if shared_experts is not None:
            self.add_module(shared_name, shared_experts)
        self.shared_gated = shared_gate is not None
        if shared_gate is not None:
            self.add_module(f"{shared_name}_gate", shared_gate)

    def route(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's ``(logits_TE, topk_weights_TK, topk_ids_TK)`` for the block's input, T = B·S."""
        return self.gate(x_BSD.reshape(-1, x_BSD.shape[-1]))

    def forward(
        self, x_BSD: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y_BSD, router_logits_TE)`` with T = B·S. ``routing``: :meth:`route`'s result for ``x_BSD`` when the
        caller ran it already (the decoder layer does, inside its compiled attention half); None routes here."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE, weights_TK, ids_TK = self.route(x_BSD) if routing is None else routing
        y_BSD = self.experts(x_TD, ids_TK, weights_TK).view_as(x_BSD)
        if self.shared_name is not None:
            shared_BSD = getattr(self, self.shared_name)(x_BSD)
            if self.shared_gated:
                shared_BSD = torch.sigmoid(getattr(self, f"{self.shared_name}_gate")(x_BSD)) * shared_BSD
            y_BSD = y_BSD + shared_BSD
        return y_BSD, logits_TE


def routers(model: nn.Module) -> list[Router]:
    """The routers of ``model``'s MoE layers, in layer order (the order of ``router_logits``)."""
    return [m for m in model.modules() if isinstance(m, Router)]
