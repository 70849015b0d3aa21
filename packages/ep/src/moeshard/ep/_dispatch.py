"""Routed experts of one MoE layer: token dispatch (all-to-all), grouped expert GEMM, combine.

# T tokens, K top-k, D hidden, E experts (global unless said), El local experts, F expert width,
# N routed copies (T*K) sent by this rank, R copies received by this rank, P EP size

Flow with EP size P > 1 (with P = 1 the same code runs with the exchanges skipped):

1. sort the N token copies by destination expert (stable), count copies per global expert ``counts_E``;
   sorted by global expert means grouped by destination rank too (expert g lives on rank ``g // El``);
2. exchange the counts with one ``all_to_all_single`` on an int tensor: ``recv_counts_PEl``;
3. the single host sync: one ``.tolist()`` of both count tensors gives the split sizes;
4. send the copies (``all_to_all_single`` with uneven splits); they arrive grouped by source rank, then local
   expert; regroup them by local expert (on the device, no sync);
5. grouped GEMM over the local experts; undo the regrouping; send the results back (reverse all-to-all);
6. un-sort and add up the K copies of each token, weighted, in float32.

Both all-to-alls are an autograd Function whose backward is the reverse all-to-all, so input and expert-weight
gradients come home to the rank that owns them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.ep._grouped import KERNELS, Backend, _activation, _gated, grouped_expert_mlp

__all__ = ["routed_experts", "set_compiled_kernels"]


def _weighted_sum(y_TKD: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    # Products and sum in float32: the routing weights are applied in float32 whatever the compute dtype.
    return (y_TKD.float() * w_TK.float().unsqueeze(-1)).sum(dim=1)


KERNELS["weighted_sum"] = _weighted_sum


def set_compiled_kernels(enabled: bool) -> None:
    """Use ``torch.compile``-fused pointwise kernels on the expert path (the gated activation; the weighted
    combine of the K copies, reading each copy once) or the eager ones. Same functions; a GPU speed option."""
    KERNELS["gated"] = torch.compile(_gated, dynamic=True) if enabled else _gated
    KERNELS["weighted_sum"] = torch.compile(_weighted_sum, dynamic=True) if enabled else _weighted_sum


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the T*K routed copies by expert, stably (ties keep token order).

    Returns:
        ``order_N``: flat copy indices (``t * K + k``) in expert order; the copy's token is ``order_N // K``.
        ``counts_E``: copies per expert (int64, on the ids' device), computed without a host sync.
    """
    ids_N = topk_ids_TK.reshape(-1)
    sorted_ids_N, order_N = torch.sort(ids_N, stable=True)
    # searchsorted gives each expert's first position in the sorted ids; bincount would sync on CUDA.
    bounds = torch.arange(num_experts + 1, device=ids_N.device, dtype=sorted_ids_N.dtype)
    counts_E = torch.diff(torch.searchsorted(sorted_ids_N, bounds)).to(torch.int64)
    return order_N, counts_E


def inverse_permutation(perm_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``a[perm][inv] == a``."""
    inv_N = torch.empty_like(perm_N)
    inv_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device, dtype=perm_N.dtype)
    return inv_N


def regroup_by_local_expert(recv_counts_PEl: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Permutation taking received rows from (source rank, local expert) order to (local expert, source rank).

    Args:
        recv_counts_PEl: ``[P, El]`` rows received from each rank for each local expert (device tensor).
        num_rows: the total ``R`` (known on the host; passing it spares repeat_interleave a sync).

    Returns:
        ``perm_R`` such that ``rows[perm_R]`` is grouped by local expert, source ranks in order within each.
    """
    P, El = recv_counts_PEl.shape
    expert_of_block = torch.arange(El, device=recv_counts_PEl.device).repeat(P)
    expert_of_row_R = torch.repeat_interleave(expert_of_block, recv_counts_PEl.reshape(-1), output_size=num_rows)
    return torch.sort(expert_of_row_R, stable=True)[1]


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` whose inverse is known; backward is the inverse gather.

    Plain advanced indexing would back-propagate through ``index_put_(accumulate=True)``, a sort-based scatter
    several times slower than this gather.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


class _ExpandRows(torch.autograd.Function):
    """``x_TD[order_N // K]``: each token copied K times, in expert order; backward adds the K copies' grads."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(inv_N)
        ctx.K = K
        return x_TD.index_select(0, order_N // K)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):  # noqa: D102
        (inv_N,) = ctx.saved_tensors
        D = grad_ND.shape[-1]
        # back to copy order t*K+k, then the K copies of token t are adjacent: a sum, no scatter.
        return grad_ND.index_select(0, inv_N).view(-1, ctx.K, D).sum(dim=1), None, None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
    """``x[perm]`` along dim 0 for a permutation, differentiable with a gather (not a scatter) backward."""
    return _PermuteRows.apply(x, perm, inverse_permutation(perm) if inv is None else inv)


def combine(
    y_sorted_ND: torch.Tensor, order_N: torch.Tensor, topk_weights_TK: torch.Tensor, inv_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Un-sort the expert outputs and add each token's K copies, weighted, in float32.

    Returns:
        ``y_TD`` in float32.
    """
    T, K = topk_weights_TK.shape
    inv_N = inverse_permutation(order_N) if inv_N is None else inv_N
    y_NkD = permute_rows(y_sorted_ND, inv_N, order_N)  # back to copy order t * K + k
    return KERNELS["weighted_sum"](y_NkD.reshape(T, K, y_sorted_ND.shape[-1]), topk_weights_TK)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:  # noqa: D102
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven ``all_to_all_single`` along dim 0 (send ``in_splits[r]`` rows to rank r)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_up_EXD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    num_experts: int,
    ep_group: dist.ProcessGroup | None = None,
    activation: str = "silu",
    backend: Backend | None = None,
) -> torch.Tensor:
    """The routed-expert output of one MoE layer, ``y = Σ_k w_k · down_e(act(gate_e x) * up_e x)``.

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
        activation: the gated activation (see :func:`grouped_expert_mlp`).
        backend: expert-GEMM backend, None for the process default (see :func:`grouped_expert_mlp`).

    Returns:
        ``y_TD`` in x's dtype.
    """
    _activation(activation)
    if x_TD.dim() != 2 or topk_ids_TK.dim() != 2 or topk_ids_TK.shape != topk_weights_TK.shape:
        raise ValueError(
            f"routed_experts takes x [T, D], topk_ids [T, K] and topk_weights [T, K], got "
            f"{tuple(x_TD.shape)}, {tuple(topk_ids_TK.shape)}, {tuple(topk_weights_TK.shape)}"
        )
    if topk_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids_TK.shape[0]} rows for {x_TD.shape[0]} tokens")
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids_TK.dtype}")
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    E_local = w_gate_up_EXD.shape[0]
    if E_local * ep_size != num_experts:
        raise ValueError(
            f"num_experts={num_experts} but the EP group of {ep_size} ranks holds {E_local} experts each "
            f"({E_local * ep_size} in all); pass the weights after apply_ep and the model's global expert count"
        )
    T, K = topk_ids_TK.shape
    order_N, counts_E = sort_by_expert(topk_ids_TK, num_experts)
    inv_N = inverse_permutation(order_N)
    x_sorted_ND = _ExpandRows.apply(x_TD, order_N, inv_N, K)

    if ep_size == 1:
        y_sorted_ND = grouped_expert_mlp(
            x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, activation=activation, backend=backend
        )
    else:
        y_sorted_ND = _dispatch_compute_return(
            x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, ep_size, ep_group, activation, backend
        )
    return combine(y_sorted_ND, order_N, topk_weights_TK, inv_N).to(x_TD.dtype)


def _dispatch_compute_return(x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, P, group, activation, backend):
    El = w_gate_up_EXD.shape[0]
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)  # El counts to and from each rank
    # The one device→host sync of the layer: the all-to-all split sizes must be host ints. Both count
    # tensors go in one .tolist() so there is a single sync, not two.
    host = torch.cat([counts_E, recv_counts_E]).tolist()
    send_counts, recv_counts = host[: P * El], host[P * El :]
    in_splits = [sum(send_counts[r * El : (r + 1) * El]) for r in range(P)]
    out_splits = [sum(recv_counts[r * El : (r + 1) * El]) for r in range(P)]
    local_counts = [sum(recv_counts[r * El + e] for r in range(P)) for e in range(El)]
    R = sum(out_splits)

    x_recv_RD = all_to_all(x_sorted_ND, out_splits, in_splits, group)
    recv_counts_PEl = recv_counts_E.view(P, El)
    perm_R = regroup_by_local_expert(recv_counts_PEl, R)
    inv_R = inverse_permutation(perm_R)
    y_grouped_RD = grouped_expert_mlp(
        permute_rows(x_recv_RD, perm_R, inv_R),
        recv_counts_PEl.sum(0),
        w_gate_up_EXD,
        w_down_EDF,
        host_counts=local_counts,
        activation=activation,
        backend=backend,
    )
    y_recv_RD = permute_rows(y_grouped_RD, inv_R, perm_R)
    return all_to_all(y_recv_RD, in_splits, out_splits, group)
