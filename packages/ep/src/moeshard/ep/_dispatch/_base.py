"""The interface of an EP dispatch strategy: route → dispatch → expert compute → combine.

# T tokens, K top-k, D hidden, E experts (global), El local experts, F expert width, N = T*K routed copies,
# P EP size

Every strategy shares the two ends, written once here: **route** sorts the N routed copies by global expert
(stably) and expands each token's row into its K copies in that order, each copy with its routing weight;
**combine** un-sorts the expert outputs and adds each token's K copies, in float32. The routing weights are
applied by the expert pass itself, to the gated activation before the down projection (the same product, a
different place for the bf16 rounding): so backward gets their gradient from the activation, and the layer keeps
no copy of the expert outputs for it (``D`` elements per routed copy). Expert ``g`` lives on EP rank ``g // El``
as local expert ``g % El``, so copies sorted by global expert are also grouped by destination rank. In between, a
strategy's :meth:`ExpertDispatch.run_experts` takes the sorted copies (and their weights) to their experts,
wherever they live, and brings the outputs back in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from moeshard.ep._expert_pass import NO_BIASES
from moeshard.ep._kernels import Activation, activation_fn, kernels_for
from moeshard.ep._lowrank import NO_DELTAS, LowRankDelta
from moeshard.ep._options import EPOptions
from moeshard.ep._permute import combine, expand_rows_and_weights
from moeshard.ep._weight_grads import WeightGradTarget

__all__ = ["ExpertDispatch", "HostSyncHooks", "recompute_contexts"]


class _SplitLog:
    """The routes, exchanged counts and sizes of one checkpointed region, recorded by its forward and replayed by its
    recompute."""

    def __init__(self) -> None:
        self.routes: list[tuple[torch.Tensor, ...]] = []  # each layer's (order, inverse, counts) (device)
        self.counts: list[torch.Tensor] = []  # each EP layer's received per-expert counts (device, tiny)
        self.sizes: list[list[int]] = []
        self.replayed: dict[str, int] = {}  # per kind, the entries the current recompute has replayed

    def rewind(self) -> None:
        """A recompute begins: replay from the first entries (a second backward through a retained graph
        recomputes again)."""
        self.replayed = {}


class _SplitMode:
    """While entered, the given dispatchers record (``"record"``) or replay (``"replay"``) their exchange sizes.

    The mode is set on the dispatcher objects themselves (the ones of the checkpointed region), not on the thread:
    whoever checkpoints a region names its EP layers."""

    def __init__(
        self, mode: str, log: _SplitLog, dispatchers: tuple[ExpertDispatch, ...], discard_outputs: bool = False
    ) -> None:
        self.mode, self.log, self.dispatchers = mode, log, dispatchers
        self.discard_outputs = discard_outputs  # replay only: the recompute's outputs are not computed
        self._outer: list[_SplitMode | None] = []

    def __enter__(self) -> _SplitMode:
        if self.mode == "replay":
            self.log.rewind()
        self._outer = [d.split_mode for d in self.dispatchers]
        for d in self.dispatchers:
            d.split_mode = self
        return self

    def __exit__(self, *exc) -> None:
        for d, outer in zip(self.dispatchers, self._outer):
            d.split_mode = outer


def recompute_contexts(
    dispatchers: Iterable[ExpertDispatch], *, discard_outputs: bool = False
) -> tuple[_SplitMode, _SplitMode]:
    """The ``context_fn`` pair for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` around a region
    whose EP layers use ``dispatchers``: the forward records each layer's route (the copies' order, its inverse and
    the per-expert counts: 16 bytes per routed copy on the device), received per-expert counts (a few hundred
    bytes) and exchange sizes (its one device→host sync), and the recompute in backward replays them instead of
    routing, exchanging and synchronising again, so activation checkpointing adds no host sync and no counts
    exchange.

    The recompute routes the same tokens the same way (checkpointing replays the forward on the same inputs), so the
    sizes are the same. A new pair per ``checkpoint`` call::

        dispatchers = [m.dispatch for m in layer.modules() if isinstance(getattr(m, "dispatch", None), ExpertDispatch)]
        checkpoint(layer, x, use_reentrant=False, context_fn=functools.partial(recompute_contexts, dispatchers))

    ``discard_outputs``: the recompute leaves out what only the layers' *outputs* need, as backward takes nothing
    of them: the down projection of every expert pass, the exchange of the outputs back to their tokens' ranks and
    the combine (their values in the recompute are then undefined; the tensors saved for backward are the same).
    Valid where nothing after an EP layer in the region saves for backward a tensor computed from its output: a
    decoder layer whose routed experts' output only flows into additions (the residual, shared experts) — what
    ``apply_activation_checkpointing`` checkpoints. Not for a region that goes on through a norm, a projection or
    another layer after the experts: those would save the undefined values.
    """
    log, dispatchers = _SplitLog(), tuple(dispatchers)
    return _SplitMode("record", log, dispatchers), _SplitMode("replay", log, dispatchers, discard_outputs)


class HostSyncHooks:
    """Callables run right before an EP layer's device→host sync (the exchange sizes, forward only).

    At that point the host is about to wait for the device to catch up, so host-side work done there (e.g.
    issuing the next layer's FSDP all-gather, see ``moeshard.prefetch``) costs no device time, whereas the same
    work done after the sync delays the next kernel launches. Hooks must not launch work the sync depends on
    or synchronise themselves. ``apply_ep`` gives one instance to all the dispatchers it installs and returns it
    as ``EPInfo.host_sync_hooks``; ``EPInfo.add_host_sync_hook(hook)`` adds to it.
    """

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    def add(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` before each sync from now on; the handle's ``remove()`` stops it."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def __call__(self) -> None:
        """Run every hook, in the order they were added."""
        for hook in list(self._hooks.values()):
            hook()

    def __len__(self) -> int:
        return len(self._hooks)


class ExpertDispatch:
    """The routed experts of one MoE layer (base class; one subclass per strategy).

    Call it as ``dispatch(x_TD, topk_ids_TK, topk_weights_TK, w_gate_up_EXD, w_down_EDF) -> y_TD`` with
    ``y = Σ_k w_k · down_e(act(gate_e x) * up_e x)``, the routing weights applied in float32, output in x's
    dtype. The weights are this EP rank's ``El = num_experts / ep_size`` experts (``w_gate_up_EXD``
    ``[El, 2F, D]``, gate rows first, then up; ``w_down_EDF`` ``[El, D, F]``). Experts and ranks without tokens
    and ``T = 0`` work; every local expert weight always gets a gradient (zeros when it saw no token), so FSDP2
    reduces the same gradients on every rank. A dispatcher holds no tensors: it is a plain attribute of its
    expert module (``module.dispatch``), installed by ``apply_ep``.

    Subclasses implement :meth:`run_experts` and call :meth:`before_host_sync` right before their one
    device→host sync, if they have one. Where :attr:`outputs_discarded` is true they may skip what only the output
    needs (the down projection, the way back).
    """

    distributed: bool = True
    """Whether the strategy runs over an EP group of 2+ ranks (False: EP size 1 only)."""

    def __init__(
        self,
        num_experts: int,
        options: EPOptions = EPOptions(),  # noqa: B008 (frozen, so one shared default is safe)
        group: dist.ProcessGroup | None = None,
        host_sync_hooks: HostSyncHooks | None = None,
    ):
        """
        Args:
            num_experts: the global number of experts, ``El * ep_size``.
            options: the strategy's options (kernel tier, GEMM backend, SM carve-out).
            group: the EP process group, None for EP size 1.
            host_sync_hooks: run before each forward's device→host sync; None for none.
        """
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if not isinstance(options, EPOptions):
            raise ValueError(f"options must be an EPOptions, got {type(options).__name__}")
        self.num_experts = num_experts
        self.options = options
        self.group = group
        self.ep_size = 1 if group is None else dist.get_world_size(group)
        self.ep_rank = 0 if group is None else dist.get_rank(group)
        self.kernels = kernels_for(options.kernels)
        self.host_sync_hooks = host_sync_hooks
        self.split_mode: _SplitMode | None = None  # set while a checkpointed region records or replays (above)
        self.weight_grads: WeightGradTarget | None = None  # see accumulate_weight_grads
        if self.distributed != (self.ep_size > 1):
            raise ValueError(
                f"{type(self).__name__} runs "
                + ("over an EP group of 2 or more ranks" if self.distributed else "every expert on this rank")
                + f", but its group has {self.ep_size} rank(s); make_dispatch picks the strategy for the EP size"
            )

    def accumulate_weight_grads(self, target: WeightGradTarget | None) -> None:
        """From now on backward asks ``target(weight)`` for a buffer to add each expert weight's gradient into (see
        ``moeshard.ep.WeightGradTarget``); None returns the gradients to autograd again. Called by the owner of
        the gradients through :meth:`moeshard.ep.EPInfo.accumulate_weight_grads`."""
        if target is not None and not callable(target):
            raise ValueError(f"the weight-gradient target must be callable or None, got {type(target).__name__}")
        self.weight_grads = target

    @classmethod
    def kept_factor_elements(cls, rows: int, hidden: int, width: int, ep_size: int) -> float:
        """What keeping one pass's weight-gradient factors holds (``moeshard.ep.WeightGradFactors``, every part of
        both weights), in elements of the compute dtype, for ``rows`` routed copies on a rank (``T · K``; at EP size
        > 1 the copies a rank computes, on average), experts of ``hidden`` D and ``width`` F: gate/up's
        ``[N, 2F]`` and ``[N, D]``, down's ``[N, D]`` and ``[N, F]``, i.e. ``N · (2D + 3F)``."""
        return rows * (2 * hidden + 3 * width)

    @classmethod
    def backward_elements(cls, rows: int, hidden: int, width: int, ep_size: int, lowrank: bool = False) -> float:
        """What one layer's backward holds at its peak beyond the tensors its forward saved, in elements of the
        compute dtype, for ``rows`` routed copies on a rank (``T · K``) of experts with ``hidden`` D and ``width`` F:
        the expert pass's working set while it forms the copies' input gradient (``ExpertPass.backward``): the
        copies' output gradient ``[N, D]`` (the combine's backward), the gated activation's gradient ``[N, F]``,
        the gate/up output's ``[N, 2F]`` and the input gradient ``[N, D]``, i.e. ``N · (2D + 3F)``. With
        ``lowrank`` (adapters on both expert weights) the gate/up delta's input gradient and its sum with the base
        one are alive beside the base one: ``2D`` more per copy. The weight gradients go into buffers their owner
        counts (or, for a frozen base, are not formed)."""
        return rows * (2 * hidden + 3 * width + (2 * hidden if lowrank else 0))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_experts={self.num_experts}, ep_size={self.ep_size}, {self.options.describe()})"
        )

    def __call__(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        w_gate_up_EXD: torch.Tensor,
        w_down_EDF: torch.Tensor,
        *,
        activation: Activation = "silu",
        deltas: tuple[LowRankDelta | None, LowRankDelta | None] = NO_DELTAS,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES,
    ) -> torch.Tensor:
        """``y_TD`` for this rank's tokens ``x_TD`` and their routing (global expert ids ``[T, K]``).

        ``activation``: a name of ``ACTIVATIONS`` or a spec (``ClampedSwiGLU``).
        ``deltas``: a :class:`~moeshard.ep.LowRankDelta` or None per expert weight (gate/up, down), this rank's
        experts like the weights: the experts compute with ``W_e + s · B_e A_e``, applied inside the expert pass
        (see :func:`~moeshard.ep._mlp.grouped_expert_mlp`).
        ``biases``: the local experts' ``(b_gate_up [E_local, 2F] | None, b_down [E_local, D] | None)``."""
        self._check(x_TD, topk_ids_TK, topk_weights_TK, w_gate_up_EXD, activation)
        K = topk_ids_TK.shape[1]
        expect = getattr(self.weight_grads, "expect_factors", None)
        if expect is not None:  # the target sizes what it would keep from shapes only (no device work)
            D, F = w_down_EDF.shape[1], w_down_EDF.shape[2]
            expect(self.kept_factor_elements(topk_ids_TK.numel(), D, F, self.ep_size))
        # route: the copies in global expert order (a checkpointed region's recompute replays its forward's)
        order_N, inv_N, counts_E = self._logged("routes", lambda: self.kernels.route(topk_ids_TK, self.num_experts))
        x_sorted_ND, w_sorted_N = expand_rows_and_weights(x_TD, topk_weights_TK, order_N, inv_N, K, self.kernels)
        # dispatch → expert compute (weighted) → back, in the same order
        y_sorted_ND = self.run_experts(
            x_sorted_ND, w_sorted_N, counts_E, w_gate_up_EXD, w_down_EDF, activation, deltas, tuple(biases)
        )
        # combine
        return combine(y_sorted_ND, order_N, inv_N, K, self.kernels, x_TD.dtype, compute=not self.outputs_discarded)

    @property
    def outputs_discarded(self) -> bool:
        """Whether this call is the recompute of a checkpointed region that discards its outputs (see
        :func:`recompute_contexts`): a strategy then computes and exchanges only what backward keeps, and returns
        rows of undefined values."""
        mode = self.split_mode
        return mode is not None and mode.mode == "replay" and mode.discard_outputs

    def run_experts(
        self,
        x_sorted_ND: torch.Tensor,
        w_sorted_N: torch.Tensor,
        counts_E: torch.Tensor,
        w_gate_up_EXD: torch.Tensor,
        w_down_EDF: torch.Tensor,
        activation: Activation,
        deltas: tuple[LowRankDelta | None, LowRankDelta | None] = NO_DELTAS,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES,
    ) -> torch.Tensor:
        """Every routed copy through its expert; returns the outputs, weighted, in the copies' order.

        Args:
            x_sorted_ND: the copies sorted by global expert (so grouped by destination rank, then local expert).
            w_sorted_N: each copy's routing weight (float32), applied by the expert pass (``row_weights`` of
                :func:`~moeshard.ep._mlp.grouped_expert_mlp`): it travels with its copy and its gradient comes home.
            counts_E: copies per global expert (device tensor).
            w_gate_up_EXD, w_down_EDF: this rank's experts.
            activation: a name of ``ACTIVATIONS`` or a spec.
            deltas: the weights' low-rank deltas (or None each), this rank's experts.
            biases: this rank's experts' ``(b_gate_up, b_down)``, each None where the experts have none.
        """
        raise NotImplementedError

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """``recv_counts_E``: the per-expert counts every rank of the group sends this one (``counts_E`` holds
        ``El`` counts for each rank, and so does the result), by one small ``all_to_all_single``.

        In the recompute of a region checkpointed with :func:`recompute_contexts`, the counts its forward received:
        no exchange."""

        def exchange() -> torch.Tensor:
            recv_counts_E = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_counts_E, counts_E, group=self.group)
            return recv_counts_E

        return self._logged("counts", exchange)

    def host_sizes(self, counts_E: torch.Tensor, recv_counts_E: torch.Tensor) -> list[int]:
        """The layer's one device→host sync: ``counts_E`` then ``recv_counts_E`` as one host list (hooks first).

        In the recompute of a region checkpointed with :func:`recompute_contexts`, the list its forward read: no
        sync and no hooks."""

        def read() -> list[int]:
            self.before_host_sync()
            return torch.cat([counts_E, recv_counts_E]).tolist()

        return self._logged("sizes", read)

    def _logged(self, kind: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, recorded in the ``kind`` queue of a checkpointed region's log by its forward and taken from
        there (not computed) by its recompute; plainly computed outside such a region."""
        mode = self.split_mode
        if mode is not None and mode.mode == "replay":
            entries, done = getattr(mode.log, kind), mode.log.replayed.get(kind, 0)
            if done >= len(entries):
                raise RuntimeError(
                    "activation-checkpoint recompute ran more EP layers than its forward: the recomputed region must "
                    "route exactly as its forward did"
                )
            mode.log.replayed[kind] = done + 1
            return entries[done]
        value = compute()
        if mode is not None and mode.mode == "record":
            getattr(mode.log, kind).append(value)
        return value

    def before_host_sync(self) -> None:
        """Run the host-sync hooks (if any); strategies call it right before their device→host sync."""
        if self.host_sync_hooks is not None:
            self.host_sync_hooks()

    def _check(self, x_TD, topk_ids_TK, topk_weights_TK, w_gate_up_EXD, activation) -> None:
        activation_fn(activation)
        if x_TD.dim() != 2 or topk_ids_TK.dim() != 2 or topk_ids_TK.shape != topk_weights_TK.shape:
            raise ValueError(
                f"routed experts take x [T, D], topk_ids [T, K] and topk_weights [T, K], got "
                f"{tuple(x_TD.shape)}, {tuple(topk_ids_TK.shape)}, {tuple(topk_weights_TK.shape)}"
            )
        if topk_ids_TK.shape[0] != x_TD.shape[0]:
            raise ValueError(f"topk_ids has {topk_ids_TK.shape[0]} rows for {x_TD.shape[0]} tokens")
        if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
            raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids_TK.dtype}")
        self._check_expert_count(w_gate_up_EXD.shape[0])

    def _check_expert_count(self, El: int) -> None:
        if El * self.ep_size != self.num_experts:
            raise ValueError(
                f"num_experts={self.num_experts} but the EP group of {self.ep_size} ranks holds {El} experts each "
                f"({El * self.ep_size} in all); pass the weights after apply_ep and the model's global expert count"
            )
