"""EP size P > 1, the plain strategy: one uneven ``all_to_all_single`` each way, nothing overlapped.

# D hidden, El local experts, P EP size, N routed copies sent by this rank (sorted by global expert),
# R copies received by this rank

The readable reference of the EP dispatch; :class:`~moeshard.ep.OverlappedDispatch` computes the same thing
faster. Flow of :meth:`AllToAllDispatch.run_experts`, given the copies sorted by global expert (so grouped by
destination rank, then by local expert there):

1. exchange the per-expert counts (one small ``all_to_all_single``): each rank learns how many copies each
   source sends to each of its local experts;
2. the layer's one device→host sync: one ``.tolist()`` of the sent and received counts gives the split sizes
   (the collectives need host ints) and the per-expert row counts of the loop backend;
3. send the copies and their routing weights (every copy, also those for this rank's own experts, which it sends
   to itself); they arrive in (source rank, local expert) order;
4. regroup them by local expert (one permutation gather), run the expert MLP, undo the regrouping;
5. send the outputs home with the reverse exchange; they arrive in the order the copies left.

Both exchanges are an autograd Function whose backward is the reverse exchange, so input and expert-weight
gradients come home to the rank that owns them; backward makes no host sync (the splits are kept).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.ep._dispatch._base import ExpertDispatch
from moeshard.ep._expert_pass import NO_BIASES
from moeshard.ep._lowrank import NO_DELTAS
from moeshard.ep._mlp import grouped_expert_mlp
from moeshard.ep._permute import inverse_permutation, permute_rows, regroup_by_local_expert

__all__ = ["AllToAllDispatch", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(  # noqa: D102
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, send: bool
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        if send:
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, *, send: bool = True):
    """Differentiable uneven ``all_to_all_single`` along dim 0 (send ``in_splits[r]`` rows to rank r, receive
    ``out_splits[r]`` rows from it); backward is the reverse exchange. ``send=False`` (on every rank of the group
    alike): the result is allocated, nothing travels (a recompute that discards its outputs)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, send)


class AllToAllDispatch(ExpertDispatch):
    """The routed experts of one MoE layer over an EP group of 2+ ranks, with plain all-to-alls (no overlap)."""

    def run_experts(
        self,
        x_sorted_ND,
        w_sorted_N,
        counts_E,
        w_gate_up_EXD,
        w_down_EDF,
        activation,
        deltas=NO_DELTAS,
        biases=NO_BIASES,
    ) -> torch.Tensor:
        """The copies to their experts' ranks and back (see :meth:`ExpertDispatch.run_experts`)."""
        P, El = self.ep_size, w_gate_up_EXD.shape[0]
        discard = self.outputs_discarded
        # 1. counts: recv_counts_E[r * El + e] = copies rank r sends to local expert e here
        recv_counts_E = self.exchange_counts(counts_E)  # replayed in a checkpoint recompute
        # 2. the one device→host sync of the layer; sent and received counts in one .tolist(), not two
        host = self.host_sizes(counts_E, recv_counts_E)  # replayed in a checkpoint recompute
        send, recv = host[: P * El], host[P * El :]
        in_splits = [sum(send[r * El : (r + 1) * El]) for r in range(P)]
        out_splits = [sum(recv[r * El : (r + 1) * El]) for r in range(P)]
        rows_per_expert = [sum(recv[r * El + e] for r in range(P)) for e in range(El)]
        # 3. the copies to their ranks, in (source rank, local expert) order
        x_recv_RD = all_to_all(x_sorted_ND, out_splits, in_splits, self.group)
        w_recv_R = all_to_all(w_sorted_N, out_splits, in_splits, self.group)
        # 4. grouped by local expert through the experts, and back to (source rank, local expert) order
        recv_counts_PEl = recv_counts_E.view(P, El)
        perm_R = regroup_by_local_expert(recv_counts_PEl, sum(out_splits))
        inv_R = None if perm_R is None else inverse_permutation(perm_R)
        x_in_RD = x_recv_RD if perm_R is None else permute_rows(x_recv_RD, perm_R, inv_R)
        w_in_R = w_recv_R if perm_R is None else permute_rows(w_recv_R, perm_R, inv_R)
        y_out_RD = grouped_expert_mlp(
            x_in_RD,
            recv_counts_PEl.sum(0),
            w_gate_up_EXD,
            w_down_EDF,
            host_counts=rows_per_expert,
            activation=activation,
            gemm=self.options.gemm,
            kernels=self.options.kernels,
            recompute=self.options.recompute,
            weight_grads=self.weight_grads,
            row_weights=w_in_R,
            deltas=deltas,
            biases=biases,
            output=not discard,
        )
        y_recv_RD = y_out_RD if perm_R is None else permute_rows(y_out_RD, inv_R, perm_R, compute=not discard)
        # 5. the outputs home, in the order the copies left (not in a recompute that discards them: every rank of
        # the group recomputes the same layer in its backward, so all skip this exchange alike)
        return all_to_all(y_recv_RD, in_splits, out_splits, self.group, send=not discard)
