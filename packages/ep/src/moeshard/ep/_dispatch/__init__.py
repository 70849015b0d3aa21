"""The EP dispatch strategies, one per module, and how one is chosen.

- :mod:`._base`: :class:`ExpertDispatch` (route → dispatch → expert compute → combine) and :class:`HostSyncHooks`;
- :mod:`.local`: :class:`LocalDispatch`, EP size 1;
- :mod:`.all_to_all`: :class:`AllToAllDispatch`, plain uneven ``all_to_all_single`` both ways (the reference);
- :mod:`.overlapped`: :class:`OverlappedDispatch`, the exchanges overlapped with the rank's own expert work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.ep._dispatch._base import ExpertDispatch, HostSyncHooks, recompute_contexts
from moeshard.ep._dispatch.all_to_all import AllToAllDispatch, all_to_all
from moeshard.ep._dispatch.local import LocalDispatch
from moeshard.ep._dispatch.overlapped import OverlappedDispatch
from moeshard.ep._kernels import Activation
from moeshard.ep._options import EPOptions

__all__ = [
    "AllToAllDispatch",
    "ExpertDispatch",
    "HostSyncHooks",
    "LocalDispatch",
    "OverlappedDispatch",
    "all_to_all",
    "backward_elements",
    "kept_factor_elements",
    "make_dispatch",
    "recompute_contexts",
    "routed_experts",
]

_STRATEGIES: dict[str, type[ExpertDispatch]] = {"overlapped": OverlappedDispatch, "all_to_all": AllToAllDispatch}


def make_dispatch(
    num_experts: int,
    group: dist.ProcessGroup | None,
    options: EPOptions = EPOptions(),  # noqa: B008 (frozen, so one shared default is safe)
    host_sync_hooks: HostSyncHooks | None = None,
) -> ExpertDispatch:
    """The dispatcher for ``options`` over ``group``: :class:`LocalDispatch` for EP size 1 (``group`` None or of
    one rank), otherwise the strategy ``options.dispatch`` names.

    Args:
        num_experts: the global number of experts.
        group: the EP process group (``ep_group(experts_module)``), or None.
        options: the :class:`~moeshard.ep.EPOptions`.
        host_sync_hooks: run right before each forward's device→host sync (EP size > 1).
    """
    if not isinstance(options, EPOptions):
        raise ValueError(f"options must be an EPOptions, got {type(options).__name__}")
    if group is None or dist.get_world_size(group) == 1:
        return LocalDispatch(num_experts, options, None, host_sync_hooks)
    return _STRATEGIES[options.dispatch](num_experts, options, group, host_sync_hooks)


def kept_factor_elements(dispatch: str, ep_size: int, rows: int, hidden: int, width: int) -> float:
    """What the dispatcher ``apply_ep`` picks for ``dispatch`` and ``ep_size`` keeps of one pass's
    weight-gradient factors, in elements of the compute dtype (:meth:`ExpertDispatch.kept_factor_elements`), for
    ``rows`` routed copies per rank (tokens · top-k) of experts with ``hidden`` D and ``width`` F; each dispatcher
    also tells its weight-gradient target this in every forward (``WeightGradTarget``'s ``expect_factors``)."""
    return _dispatcher_class(dispatch, ep_size).kept_factor_elements(rows, hidden, width, ep_size)


def backward_elements(
    dispatch: str, ep_size: int, rows: int, hidden: int, width: int, *, lowrank: bool = False
) -> float:
    """What the dispatcher ``apply_ep`` picks for ``dispatch`` and ``ep_size`` holds at the peak of one layer's
    backward beyond what its forward saved, in elements of the compute dtype
    (:meth:`ExpertDispatch.backward_elements`), for ``rows`` routed copies per rank (tokens · top-k) of experts
    with ``hidden`` D and ``width`` F; ``lowrank``: the expert weights carry low-rank deltas (adapters)."""
    return _dispatcher_class(dispatch, ep_size).backward_elements(rows, hidden, width, ep_size, lowrank)


def _dispatcher_class(dispatch: str, ep_size: int) -> type[ExpertDispatch]:
    if dispatch not in _STRATEGIES:
        raise ValueError(f"dispatch must be one of {', '.join(sorted(_STRATEGIES))}, got {dispatch!r}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    return LocalDispatch if ep_size == 1 else _STRATEGIES[dispatch]


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_up_EXD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    num_experts: int,
    ep_group: dist.ProcessGroup | None = None,
    activation: Activation = "silu",
    options: EPOptions | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> torch.Tensor:
    """The routed-expert output of one MoE layer, ``y = Σ_k w_k · down_e(act(gate_e x) * up_e x)``.

    The functional form of ``make_dispatch(num_experts, ep_group, options)(...)`` (see :class:`ExpertDispatch`).
    One code path for every EP size: with ``ep_group`` None (or of size 1) everything is local and no process
    group is needed. Global expert ``g`` lives on EP rank ``g // E_local`` as local expert ``g % E_local``.
    Forward makes exactly one device→host sync when EP size > 1 (the split sizes), zero or one otherwise
    (none with the grouped_mm backend, the loop backend's counts otherwise); backward makes none.

    Args:
        x_TD: this rank's tokens ``[T, D]`` (T may be 0).
        topk_ids_TK: global expert ids ``[T, K]``.
        topk_weights_TK: routing weights ``[T, K]``, applied in float32.
        w_gate_up_EXD: local experts' ``[E_local, 2F, D]`` (gate rows first, then up).
        w_down_EDF: local experts' ``[E_local, D, F]``.
        num_experts: the global number of experts, ``E_local * ep_size``.
        ep_group: the EP process group (``ep_group(experts_module)``), or None.
        activation: the gated activation, a name of ``ACTIVATIONS`` or a spec (``ClampedSwiGLU``).
        options: strategy, kernels and GEMM backend; None for ``EPOptions()``.
        biases: the local experts' ``(b_gate_up [E_local, 2F] | None, b_down [E_local, D] | None)``.

    Returns:
        ``y_TD`` in x's dtype.
    """
    dispatch = make_dispatch(num_experts, ep_group, EPOptions() if options is None else options)
    return dispatch(x_TD, topk_ids_TK, topk_weights_TK, w_gate_up_EXD, w_down_EDF, activation=activation, biases=biases)
