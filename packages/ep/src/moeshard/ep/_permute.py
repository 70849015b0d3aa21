"""Sorting routed copies by expert and the permutations around the expert compute, with gather backwards.

# T tokens, K top-k, D hidden, E experts, El local experts, N = T*K routed copies (copy t*K+k is token t's k-th),
# S sources of received rows, R received rows

Every backward here is a gather through the inverse permutation (no atomic scatter-add), which is deterministic
and, for the row expansion, reads each token's K copies once.
"""

from __future__ import annotations

import torch

from moeshard.ep._kernels import Kernels
from moeshard.ep._sort import inverse_permutation, narrow_keys, sort_by_expert

__all__ = [
    "combine",
    "expand_rows",
    "expand_rows_and_weights",
    "inverse_permutation",
    "narrow_keys",
    "permute_rows",
    "regroup_by_local_expert",
    "sort_by_expert",
]


def regroup_by_local_expert(recv_counts_SEl: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """Permutation taking received rows from (source, local expert) order to (local expert, source) order.

    Args:
        recv_counts_SEl: ``[S, El]`` rows received from each source for each local expert (device tensor).
        num_rows: the total ``R`` (known on the host; passing it spares repeat_interleave a sync).

    Returns:
        ``perm_R`` such that ``rows[perm_R]`` is grouped by local expert, sources in order within each; None
        when there is one source: its rows already come grouped by local expert (no gather needed).
    """
    S, El = recv_counts_SEl.shape
    if S == 1:
        return None
    expert_of_block = narrow_keys(torch.arange(El, device=recv_counts_SEl.device), El).repeat(S)
    expert_of_row_R = torch.repeat_interleave(expert_of_block, recv_counts_SEl.reshape(-1), output_size=num_rows)
    return torch.sort(expert_of_row_R, stable=True)[1]


class _ExpandRows(torch.autograd.Function):
    """``x_TD[order_N // K]``: each token copied K times, in expert order, and (with ``w_TK``) each copy's routing
    weight ``w[order_N]`` in float32; backward adds the K copies' grads and gathers the weights' back. One
    autograd node for both (the MoE layer's host time is on the critical path at small micro-batches)."""

    @staticmethod
    def forward(ctx, x_TD, w_TK, order_N, inv_N, K: int, kernels: Kernels):  # noqa: D102
        ctx.save_for_backward(inv_N)
        ctx.set_materialize_grads(False)  # an output without a gradient gets no pass over zeros
        ctx.K, ctx.kernels = K, kernels
        ctx.w_meta = None if w_TK is None else (w_TK.shape, w_TK.dtype)
        w_sorted_N = None if w_TK is None else w_TK.reshape(-1).index_select(0, order_N).float()
        return kernels.expand_rows(x_TD, order_N, inv_N, K), w_sorted_N

    @staticmethod
    def backward(ctx, grad_ND, grad_w_N):  # noqa: D102
        (inv_N,) = ctx.saved_tensors
        # back to copy order t*K+k, then the K copies of token t are adjacent: a sum, no scatter.
        gx = None
        if ctx.needs_input_grad[0] and grad_ND is not None:
            gx = ctx.kernels.gather_sum(grad_ND.contiguous(), inv_N, ctx.K)
        gw = None
        if ctx.needs_input_grad[1] and grad_w_N is not None:
            shape, dtype = ctx.w_meta
            gw = grad_w_N.index_select(0, inv_N).view(shape).to(dtype)  # copy t*K+k's gradient, a gather
        return gx, gw, None, None, None, None


def expand_rows(x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int, kernels: Kernels):
    """``x_sorted_ND = x_TD[order_N // K]`` under autograd (see :func:`sort_by_expert`); ``inv_N`` is the inverse
    of ``order_N``, used by the backward."""
    return _ExpandRows.apply(x_TD, None, order_N, inv_N, K, kernels)[0]


def expand_rows_and_weights(
    x_TD: torch.Tensor, topk_weights_TK: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int, kernels
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_sorted_ND, w_sorted_N)``: :func:`expand_rows` and each copy's routing weight ``w[order_N]`` in float32,
    in the copies' (expert) order, for the expert pass that applies it (see ``ExpertPass``), under autograd."""
    return _ExpandRows.apply(x_TD, topk_weights_TK, order_N, inv_N, K, kernels)


class _SumCopies(torch.autograd.Function):
    """``Σ_k y_sorted[inv[t*K+k]]``: each token's K copies (weighted by the expert pass already) un-sorted and added
    in float32, rounded once; backward hands each copy its token's gradient (the row expansion). The adjoint of
    :class:`_ExpandRows`, and like it nothing of the copies is kept: only the order."""

    @staticmethod
    def forward(  # noqa: D102
        ctx, y_sorted_ND, order_N, inv_N, K: int, kernels: Kernels, out_dtype: torch.dtype, compute: bool
    ):
        ctx.save_for_backward(order_N, inv_N)
        ctx.K, ctx.kernels, ctx.dtype = K, kernels, y_sorted_ND.dtype
        if not compute:
            return y_sorted_ND.new_empty((y_sorted_ND.shape[0] // K, y_sorted_ND.shape[1]), dtype=out_dtype)
        return kernels.gather_sum(y_sorted_ND.contiguous(), inv_N, K).to(out_dtype)

    @staticmethod
    def backward(ctx, g_TD):  # noqa: D102
        order_N, inv_N = ctx.saved_tensors
        gy = ctx.kernels.expand_rows(g_TD.to(ctx.dtype).contiguous(), order_N, inv_N, ctx.K)
        return gy, None, None, None, None, None, None


def combine(
    y_sorted_ND: torch.Tensor,
    order_N: torch.Tensor,
    inv_N: torch.Tensor,
    K: int,
    kernels: Kernels,
    out_dtype: torch.dtype | None = None,
    *,
    compute: bool = True,
) -> torch.Tensor:
    """Un-sort the expert outputs (already weighted by the expert pass) and add each token's K copies in float32.

    ``compute=False``: the result is allocated but not computed (a recompute that discards its outputs); the
    backward and what it saves are the same.

    Returns:
        ``y_TD``, the float32 sum rounded once to ``out_dtype`` (None: the outputs' dtype).
    """
    return _SumCopies.apply(y_sorted_ND, order_N, inv_N, K, kernels, out_dtype or y_sorted_ND.dtype, compute)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, perm_R, inv_R, compute: bool):  # noqa: D102
        ctx.save_for_backward(inv_R)
        return x_RD.index_select(0, perm_R) if compute else x_RD.new_empty(x_RD.shape)

    @staticmethod
    def backward(ctx, grad_RD):  # noqa: D102
        (inv_R,) = ctx.saved_tensors
        return grad_RD.index_select(0, inv_R), None, None, None


def permute_rows(x_RD: torch.Tensor, perm_R: torch.Tensor, inv_R: torch.Tensor, *, compute: bool = True):
    """``x_RD[perm_R]`` under autograd, whose backward gathers through ``inv_R`` (the inverse of ``perm_R``);
    ``compute=False``: allocated, not computed (as :func:`combine`)."""
    return _PermuteRows.apply(x_RD, perm_R, inv_R, compute)
