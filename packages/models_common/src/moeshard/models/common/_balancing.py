"""Expert balancing for a training loop: one object with the hooks a loop calls, and the losses it is made of.

What balances the experts is not the model's business (the model returns the LM loss and transformers' aux loss
as separate values, :class:`CausalLMOutput`); a loop builds a :class:`Balancing` from
:class:`BalancingOptions` and calls its hooks in this order, every step::

    balancing = Balancing(model, BalancingOptions(aux_loss_coef=1e-3, scope="global_batch"), device=device)
    balancing.start_step(len(micro_batches))
    for b in micro_batches:
        out = model(b.input_ids, labels=b.labels, output_router_logits=True, return_logits=False, ...)
        term = balancing.micro_batch_loss(out, b.attention_mask, rows=b.input_ids.shape[0])  # before backward
        (out.lm_loss + term).backward()
    step = balancing.end_step()          # after the last backward: the step's aux / z-loss means, expert load
    optimizer.step()
    balancing.after_optimizer_step()     # aux-loss-free balancing: the routers' selection biases move

Its parts (usable alone): transformers' :func:`load_balancing_loss`; :func:`expert_counts` and
:class:`GlobalExpertCounts` (the step's expert load over micro-batches and ranks, no host sync);
:func:`global_balancing_loss` (the aux loss with a global batch's expert frequencies);
:func:`sequence_balancing_loss` (DeepSeek-V3's complementary sequence-wise balance loss); :func:`router_z_loss`
(ST-MoE) and :func:`update_router_bias` (DeepSeek-V3's aux-loss-free balancing).

Under sequence parallelism (``sequence_group``: the ranks sharing each row, each holding a shard of its tokens)
every statistic a loss takes over its tokens (expert counts, summed probabilities, token counts, z-loss sums) is
summed over the group before the losses' products and quotients, so each token counts once and every rank of the
group computes the loss of the whole rows. The sums that carry a gradient are all-reduced with autograd
(``_torch_internals.all_reduce_sum``, what ``torch.distributed.nn.functional.all_reduce`` did before torch deprecated
it: its backward sums the group's gradients, ``sp`` times the whole-row loss's, which FSDP's mean over
``world = sp · dp`` ranks turns into the mean over the dp groups).

Legend: T tokens, B rows (sequences) of a micro-batch, S tokens per row, K top-k, E experts, L MoE layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeshard.models.common._expert_load import GlobalExpertCounts, expert_counts
from moeshard.models.common._moe import routers
from moeshard.models.common._sequence_balance import sequence_balancing_loss, sequence_rows
from moeshard.models.common._topk import kernel_takes
from moeshard.models.common._torch_internals import all_reduce_sum
from moeshard.models.common._weighted_counts import weighted_counts

__all__ = [
    "SCOPES",
    "Balancing",
    "BalancingOptions",
    "GlobalExpertCounts",
    "StepBalance",
    "expert_counts",
    "global_balancing_loss",
    "load_balancing_loss",
    "router_z_loss",
    "sequence_balancing_loss",
    "update_router_bias",
]

SCOPES = ("micro_batch", "global_batch", "sequence")
"""Values of :attr:`BalancingOptions.scope`."""


@dataclass(frozen=True)
class BalancingOptions:
    """How a loop balances the experts; validated on construction (``ValueError``).

    Attributes:
        aux_loss_coef: the load-balancing loss's coefficient (transformers' ``router_aux_loss_coef``; 0: none).
        scope: ``micro_batch`` (transformers' loss, per rank and micro-batch), ``global_batch`` (the expert
            frequencies of the step's micro-batches so far over all ranks: :func:`global_balancing_loss`) or
            ``sequence`` (DeepSeek-V3's complementary sequence-wise balance loss, per row of the micro-batch with
            the routers' own selection and affinities: :func:`sequence_balancing_loss`; DeepSeek-V3 used a
            coefficient of 1e-4; ``micro_batch_loss`` needs the rows: the attention mask or ``rows=``).
        z_loss_coef: the router z-loss's coefficient (0: not computed).
        router_bias_rate: aux-loss-free balancing's update rate (None: no router bias; the routers must have one,
            ``model.enable_router_bias()``, when it is set).
    """

    aux_loss_coef: float = 0.0
    scope: str = "micro_batch"
    z_loss_coef: float = 0.0
    router_bias_rate: float | None = None

    def __post_init__(self) -> None:
        for name in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"BalancingOptions.{name}={value!r} is not allowed: a number >= 0")
        if self.scope not in SCOPES:
            raise ValueError(f"BalancingOptions.scope={self.scope!r} is not one of {SCOPES}")
        rate = self.router_bias_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0):
            raise ValueError(f"BalancingOptions.router_bias_rate={rate!r} is not allowed: None or a number > 0")


@dataclass
class StepBalance:
    """One step's balancing figures (device tensors, this rank's; no host sync).

    Attributes:
        aux_loss: the mean over the micro-batches of the aux loss used (scope's form).
        z_loss: the mean router z-loss, or None without ``z_loss_coef``.
        expert_load: ``[L, E]`` tokens routed to each expert in the step over all ranks, or None without MoE layers.
    """

    aux_loss: torch.Tensor
    z_loss: torch.Tensor | None
    expert_load: torch.Tensor | None


class Balancing:
    """The balancing terms of a training step, as named hooks (see the module docstring for the order).

    Args:
        model: the model whose routers balance (their ``bias`` is the aux-loss-free selection bias).
        options: see :class:`BalancingOptions`.
        device: where the step's losses live.
        group: the process group the expert counts are summed over (None: the default group, or none).
        sequence_group: the ranks sharing each row under sequence parallelism (None: none); the losses' statistics
            are summed over it (see the module docstring). The masks given to :meth:`micro_batch_loss` are then the
            shard's.

    Raises:
        ValueError: ``router_bias_rate`` set but the routers have no bias.
    """

    def __init__(
        self,
        model: nn.Module,
        options: BalancingOptions,
        *,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        sequence_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(options, BalancingOptions):
            raise ValueError(f"options must be a BalancingOptions, got {type(options).__name__}")
        self.model, self.options, self.device = model, options, torch.device(device)
        self.routers = routers(model)
        self.top_k = model.config.num_experts_per_tok
        if options.router_bias_rate is not None and any(r.selection_bias is None for r in self.routers):
            raise ValueError(
                "BalancingOptions.router_bias_rate is set but the routers have no bias: call "
                "model.enable_router_bias() before building the Balancing"
            )
        self.counts = GlobalExpertCounts(group)
        self.sequence_group = sequence_group if sequence_group is not None and _size(sequence_group) > 1 else None
        self._n = 1
        self._aux_sum = self._z_sum = torch.zeros((), device=self.device)
        self._load: torch.Tensor | None = None

    def start_step(self, num_micro_batches: int) -> None:
        """Before the step's first forward: forget the last step, expect ``num_micro_batches`` micro-batches."""
        if num_micro_batches < 1:
            raise ValueError(f"a step has at least one micro-batch, got {num_micro_batches}")
        self.counts.reset()
        self._n = num_micro_batches
        self._aux_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._z_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._load = None

    def micro_batch_loss(
        self, out, attention_mask_BS: torch.Tensor | None = None, *, rows: int | None = None
    ) -> torch.Tensor:
        """Before a micro-batch's backward: the balancing term to add to its LM loss, ``(aux_coef · aux + z_coef ·
        z) / num_micro_batches`` (the balancing losses are per-micro-batch means, averaged over the step).

        Args:
            out: the model's output with ``output_router_logits=True`` (its ``aux_loss``, ``router_logits`` and, where
                it has them, ``router_ids``: then the expert counts and the ``sequence`` scope use the selection
                that routed the tokens, not a new one).
            attention_mask_BS: the micro-batch's mask (None unless padded): padding routes nowhere.
            rows: the micro-batch's rows B (its sequences); the ``sequence`` scope needs them, from here or from
                ``attention_mask_BS`` (both given: they must agree); the other scopes ignore it.

        Raises:
            ValueError: the ``sequence`` scope without ``attention_mask_BS`` or ``rows``, or with rows that do not
                fit the mask or the router logits.
        """
        o, zero = self.options, torch.zeros((), device=self.device)
        aux = out.aux_loss if out.aux_loss is not None else zero
        z = zero
        sg = self.sequence_group
        if out.router_logits:
            global_scope = o.scope == "global_batch"
            router_ids = getattr(out, "router_ids", None)  # the selection that routed the tokens, if handed on
            counts = expert_counts(
                out.router_logits,
                self.top_k,
                attention_mask_BS=attention_mask_BS,
                routers=self.routers,
                router_ids=router_ids,
            )
            running = self.counts.add(counts, all_reduce=global_scope)
            if global_scope:  # the expert frequencies of micro-batches 1..m of this step, all ranks
                aux = global_balancing_loss(out.router_logits, running, self.top_k, attention_mask_BS, group=sg)
            elif o.scope == "sequence":
                b = sequence_rows(attention_mask_BS, rows)
                aux = sequence_balancing_loss(
                    out.router_logits, self.routers, self.top_k, b, attention_mask_BS, router_ids=router_ids, group=sg
                )
            elif sg is not None:  # the model's own aux loss is its shard's: the whole rows' instead
                aux = load_balancing_loss(out.router_logits, counts.shape[-1], self.top_k, attention_mask_BS, group=sg)
            if o.z_loss_coef:
                z = router_z_loss(out.router_logits, attention_mask_BS, group=sg)
        self._aux_sum += aux.detach().float() / self._n
        self._z_sum += z.detach().float() / self._n
        return (o.aux_loss_coef * aux + o.z_loss_coef * z) / self._n

    def end_step(self) -> StepBalance:
        """After the step's last backward: its figures; the expert load is summed over the ranks here (one
        all-reduce, unless ``global_batch`` did it micro-batch by micro-batch; every rank must call it alike)."""
        self._load = self.counts.total()
        return StepBalance(self._aux_sum, self._z_sum if self.options.z_loss_coef else None, self._load)

    def after_optimizer_step(self) -> None:
        """After the optimizer step: with ``router_bias_rate``, move the routers' biases (:func:`update_router_bias`,
        the same counts on every rank: the same biases)."""
        if self.options.router_bias_rate is not None and self._load is not None:
            update_router_bias(self.model, self._load, self.options.router_bias_rate)


# ---- the losses and counts ---------------------------------------------------------------------------------------


@functools.cache
def _counts_kernel() -> Callable | None:
    """The Triton counts kernel (``_topk_triton.topk_counts``), or None where triton cannot be imported (asked only
    for CUDA tensors)."""
    try:
        from moeshard.models.common._topk_triton import topk_counts
    except ImportError:
        return None
    return topk_counts


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask_BS: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
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
        group: a sequence group: the counts and probabilities are its tokens' (see the module docstring).
    """
    if not router_logits:
        return torch.zeros((), dtype=torch.float32)
    device = router_logits[0].device
    # All layers at once, as transformers concatenates them: one softmax, one top-k and one scatter per call
    # instead of per layer (the layers' token counts and probabilities are summed over all their tokens anyway).
    logits_NE = torch.cat([lg.to(device) for lg in router_logits]) if len(router_logits) > 1 else router_logits[0]
    # Softmax in the logits' dtype (not forced to float32) to match transformers in bf16 too.
    probs_NE = torch.softmax(logits_NE, dim=-1)
    if attention_mask_BS is None:
        weight_N = torch.ones(probs_NE.shape[0], dtype=torch.float32, device=device)
    else:
        weight_N = attention_mask_BS.reshape(-1).to(device, torch.float32).repeat(len(router_logits))
    kernel = _counts_kernel() if probs_NE.is_cuda and kernel_takes(num_experts, top_k) else None
    if kernel is not None:
        # torch.topk's selection counted in one kernel instead of a radix select, a sort and a scatter: the same
        # counts, ties filled in index order as CUDA's topk fills them.
        tokens_per_expert_E = kernel(probs_NE.detach(), weight_N, top_k)
    else:
        _, ids_NK = torch.topk(probs_NE, top_k, dim=-1)
        tokens_per_expert_E = weighted_counts(ids_NK.reshape(-1), weight_N.repeat_interleave(top_k), num_experts)
    if attention_mask_BS is None:  # one float32 reduction of the 16-bit probabilities, no float32 copy of them
        prob_per_expert_E = probs_NE.sum(dim=0, dtype=torch.float32)
    else:
        prob_per_expert_E = (probs_NE.float() * weight_N[:, None]).sum(dim=0)
    rows = weight_N.sum()
    if group is not None:
        tokens_per_expert_E, rows = _group_sum(tokens_per_expert_E.float(), group), _group_sum(rows, group)
        prob_per_expert_E = _group_sum(prob_per_expert_E, group, grad=True)
    return num_experts * torch.sum((tokens_per_expert_E / rows) * (prob_per_expert_E / rows))


def global_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    counts_LE: torch.Tensor,
    top_k: int,
    attention_mask_BS: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Load-balancing loss with the expert frequencies of a larger batch: ``mean_l E · Σ_e f_le · P_le``.

    ``f_le``: the fraction of layer ``l``'s tokens routed to expert ``e`` according to ``counts_LE`` (e.g. the step's
    counts over all micro-batches so far and all ranks, from :func:`expert_counts` all-reduced: no gradient; the
    ``f`` of a layer sum to ``top_k``, as in transformers' loss, so the same coefficient applies); ``P_le``: the
    mean router probability of expert ``e`` over this call's tokens (the gradient flows through it). With this
    call's own counts it is transformers' loss computed per layer and averaged over layers. ``group``: a sequence
    group, whose tokens' probabilities ``P`` are (see the module docstring).
    """
    f_LE = counts_LE * top_k / counts_LE.sum(-1, keepdim=True).clamp_min(1.0)
    p_rows, n_rows = [], []
    mask_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1, 1).float()
    for logits_TE in router_logits:
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if mask_T is None:
            p_rows.append(probs_TE.sum(0))
            n_rows.append(torch.full((), float(probs_TE.shape[0]), device=probs_TE.device))
        else:
            m = mask_T.to(probs_TE.device)
            p_rows.append((probs_TE * m).sum(0))
            n_rows.append(m.sum())
    p_LE, n_L = torch.stack(p_rows), torch.stack(n_rows)
    if group is not None:
        p_LE, n_L = _group_sum(p_LE, group, grad=True), _group_sum(n_L, group)
    p_LE = p_LE / n_L.clamp_min(1.0)[:, None]
    return counts_LE.shape[-1] * (f_LE.to(p_LE.device) * p_LE).sum(-1).mean()


def router_z_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    attention_mask_BS: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens and MoE layers of ``logsumexp(logits)²`` (float32); over a
    sequence group's tokens with ``group`` (see the module docstring)."""
    mask_T = None if attention_mask_BS is None else attention_mask_BS.reshape(-1).float()
    sums, counts = [], []
    for logits_TE in router_logits:
        z_T = torch.logsumexp(logits_TE.float(), dim=-1).square()
        if mask_T is None:
            sums.append(z_T.sum())
            counts.append(torch.full((), float(z_T.shape[0]), device=z_T.device))
        else:
            m = mask_T.to(z_T.device)
            sums.append((z_T * m).sum())
            counts.append(m.sum())
    sum_L, n_L = torch.stack(sums), torch.stack(counts)
    if group is not None:
        sum_L, n_L = _group_sum(sum_L, group, grad=True), _group_sum(n_L, group)
    return (sum_L / n_L.clamp_min(1.0)).mean()


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _group_sum(t: torch.Tensor, group: dist.ProcessGroup, *, grad: bool = False) -> torch.Tensor:
    """``t`` summed over ``group``; with ``grad`` differentiable (the backward sums the group's gradients)."""
    if grad:
        return all_reduce_sum(t, group=group)
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


@torch.no_grad()
def update_router_bias(model: nn.Module, load_LE: torch.Tensor, update_rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3's rule, its paper's γ = ``update_rate``): after an optimizer step, move
    each router's selection bias (``selection_bias``: Qwen3-MoE's ``bias``, DeepSeek-V3's ``e_score_correction_bias``)
    by ``update_rate`` towards balance, ``bias_e += γ · sign(mean load - load_e)``: under-loaded experts up,
    over-loaded down. ``load_LE``: the step's global expert counts (identical on every rank, so are the biases)."""
    rs = routers(model)
    if len(rs) != load_LE.shape[0]:
        raise ValueError(f"load has {load_LE.shape[0]} layers but the model has {len(rs)} MoE layers")
    for router, load_E in zip(rs, load_LE):
        bias = router.selection_bias
        if bias is None:
            raise ValueError("the routers have no bias: call model.enable_router_bias() before training")
        load_E = load_E.to(bias.device, torch.float32)
        bias.add_(update_rate * torch.sign(load_E.mean() - load_E))
