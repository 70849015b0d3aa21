"""The two all-to-alls of Ulysses: sequence shards to head shards and back, each one's backward the other.

Legend: B rows, S tokens per row, s = S / sp tokens of one shard, H heads, h = H / sp heads of one rank, D head
width; ``sp`` ranks form the sequence group, rank ``r`` holding tokens ``[r·s, (r+1)·s)`` and, after the exchange,
heads ``[r·h, (r+1)·h)``. The default layout is the attention call's, heads before tokens: ``[B, H, s, D] ->
[B, h, S, D]``; ``head_dim`` / ``seq_dim`` name others (``[B, s, H, D]``: ``head_dim=2, seq_dim=1``).

Each exchange is one ``all_to_all_single`` of equal splits: the sender cuts its tensor into ``sp`` head chunks
(chunk ``j`` goes to rank ``j``); the receiver stacks the ``sp`` pieces it gets along the tokens, in rank order. The
inverse cuts the tokens and stacks the heads. Without a group, or in a group of one, both are the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

SequenceGroup = ProcessGroup | DeviceMesh | None
"""The ranks that share a row: a process group, a 1-D ``DeviceMesh``, or None (no sequence parallelism)."""


def as_process_group(group: SequenceGroup) -> ProcessGroup | None:
    """The process group of ``group`` (a 1-D mesh's), or None where there is nothing to exchange (one rank)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"the sequence group must be a 1-D DeviceMesh, got {group.ndim} dims {group.shape}")
        group = group.get_group()
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _exchange(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``all_to_all_single`` of ``x`` ``[sp, ...]`` (piece ``j`` to rank ``j``): the pieces received, by rank."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup, head_dim: int, seq_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    x_HsR = x.movedim((head_dim, seq_dim), (0, 1))
    H, s = x_HsR.shape[:2]
    assert H % sp == 0, f"{H} heads over {sp} ranks (checked by the callers)"
    got = _exchange(x_HsR.reshape(sp, H // sp, s, *x_HsR.shape[2:]), group)  # [sp (source rank), h, s, ...]
    x_hSR = got.transpose(0, 1).reshape(H // sp, sp * s, *x_HsR.shape[2:])
    return x_hSR.movedim((0, 1), (head_dim, seq_dim))


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup, head_dim: int, seq_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    x_hSR = x.movedim((head_dim, seq_dim), (0, 1))
    h, S = x_hSR.shape[:2]
    assert S % sp == 0, f"{S} tokens over {sp} ranks (checked by the callers)"
    send = x_hSR.reshape(h, sp, S // sp, *x_hSR.shape[2:]).transpose(0, 1)  # [sp (destination rank), h, s, ...]
    got = _exchange(send, group)  # [sp (source rank = head chunk), h, s, ...]
    x_HsR = got.reshape(sp * h, S // sp, *x_hSR.shape[2:])
    return x_HsR.movedim((0, 1), (head_dim, seq_dim))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, head_dim, seq_dim):  # noqa: D102
        ctx.group, ctx.head_dim, ctx.seq_dim = group, head_dim, seq_dim
        return _seq_to_heads(x, group, head_dim, seq_dim)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _heads_to_seq(grad, ctx.group, ctx.head_dim, ctx.seq_dim), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, head_dim, seq_dim):  # noqa: D102
        ctx.group, ctx.head_dim, ctx.seq_dim = group, head_dim, seq_dim
        return _heads_to_seq(x, group, head_dim, seq_dim)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return _seq_to_heads(grad, ctx.group, ctx.head_dim, ctx.seq_dim), None, None, None


def _dims(x: torch.Tensor, head_dim: int, seq_dim: int) -> tuple[int, int]:
    head_dim, seq_dim = head_dim % x.dim(), seq_dim % x.dim()
    if head_dim == seq_dim:
        raise ValueError(f"head_dim and seq_dim are both dim {head_dim}; they must name two dims of the tensor")
    return head_dim, seq_dim


def sequence_to_heads(x: torch.Tensor, group: SequenceGroup, *, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """Trade this rank's tokens of every head for all tokens of its heads: ``[B, H, s, D] -> [B, H/sp, S, D]``.

    Rank ``r`` gets heads ``[r·H/sp, (r+1)·H/sp)``, the tokens in row order. Differentiable: its backward is
    :func:`heads_to_sequence`. The identity without a group or in a group of one.

    Args:
        x: a tensor with ``H`` heads on ``head_dim`` and this rank's ``s`` tokens on ``seq_dim``.
        group: the sequence group (see :data:`SequenceGroup`).
        head_dim, seq_dim: where heads and tokens are (default: the attention call's ``[B, H, S, D]``).
    """
    pg = as_process_group(group)
    if pg is None:
        return x
    head_dim, seq_dim = _dims(x, head_dim, seq_dim)
    sp = dist.get_world_size(pg)
    if x.shape[head_dim] % sp:
        raise ValueError(
            f"{x.shape[head_dim]} heads cannot be split over a sequence group of {sp} ranks; use an sp size that "
            "divides the heads (key/value heads: replicate them first, see replicate_kv_heads)"
        )
    return _SeqToHeads.apply(x, pg, head_dim, seq_dim)


def heads_to_sequence(x: torch.Tensor, group: SequenceGroup, *, head_dim: int = 1, seq_dim: int = 2) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: ``[B, H/sp, S, D] -> [B, H, s, D]``.

    This rank gets its token shard of every head. Differentiable: its backward is :func:`sequence_to_heads`. The
    identity without a group or in a group of one.

    Args:
        x: a tensor with this rank's ``H/sp`` heads on ``head_dim`` and the row's ``S`` tokens on ``seq_dim``.
        group: the sequence group (see :data:`SequenceGroup`).
        head_dim, seq_dim: where heads and tokens are (default: the attention call's ``[B, H, S, D]``).
    """
    pg = as_process_group(group)
    if pg is None:
        return x
    head_dim, seq_dim = _dims(x, head_dim, seq_dim)
    sp = dist.get_world_size(pg)
    if x.shape[seq_dim] % sp:
        raise ValueError(
            f"{x.shape[seq_dim]} tokens cannot be split over a sequence group of {sp} ranks; set seq_len to a "
            f"multiple of {sp}"
        )
    return _HeadsToSeq.apply(x, pg, head_dim, seq_dim)
