"""Attention on head shards: any attention call of the models' shape, run between the two all-to-alls.

Legend: B rows, S tokens per row, s = S / sp tokens of one shard, H query heads, G key/value heads, D head width.

The models call ``attn_fn(q [B, H, S, Dq], k [B, G, S, Dq], v [B, G, S, Dv], mask, **kw)`` (their shared ``attend``:
SDPA, flex_attention with a ``BlockMask``, varlen kernels), with a mask built for the whole row. Under sequence
parallelism each rank holds ``s`` tokens of every head: :func:`ulysses_attention` trades them for the ``S`` tokens
of ``H/sp`` query heads (and of the key/value heads those read), runs ``attn_fn`` unchanged on the whole row's mask,
and trades the output back. Everything per token before (projections, norms, RoPE at the whole row's positions) and
after (the output projection) runs on the local shard.

Grouped-query attention: query head ``q`` reads key/value head ``q // (H/G)``. Rank ``r`` attends with query heads
``[r·H/sp, (r+1)·H/sp)``; where ``G`` is a multiple of ``sp`` it gets key/value heads ``[r·G/sp, (r+1)·G/sp)``,
exactly those. Where ``sp`` exceeds ``G`` (Qwen3-30B-A3B: 4 key/value heads), or does not divide it, each key/value
head is repeated ``k = lcm(G, sp) / G`` times in place (copy ``j`` of the ``G·k`` is head ``j // k``) before the
exchange: then ``sp`` divides ``G·k`` and ``G·k`` divides ``H``, rank ``r`` gets copies ``[r·G·k/sp,
(r+1)·G·k/sp)``, and its query head ``q`` reads copy ``q // (H/(G·k))``, which is head ``q // (H/G)``, as without
sequence parallelism. The copies' gradients sum back into their head in the repeat's backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeshard.sequence._all_to_all import SequenceGroup, as_process_group, heads_to_sequence, sequence_to_heads
from moeshard.sequence._shard import check_sequence_parallel


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """How many times each key/value head is repeated before the exchange: ``lcm(G, sp) / G``.

    1 where ``sp`` divides ``G``; otherwise the copies let every rank get the key/value heads its query heads read
    (see the module's note)."""
    check_sequence_parallel(sp_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return math.lcm(num_kv_heads, sp_size) // num_kv_heads


def replicate_kv_heads(kv_BGSD: torch.Tensor, num_heads: int, sp_size: int, *, head_dim: int = 1) -> torch.Tensor:
    """``kv`` with each of its ``G`` heads repeated ``k`` = :func:`kv_replication` times in place.

    ``[B, G, s, D] -> [B, G·k, s, D]``, copy ``j`` being head ``j // k``; the tensor itself where ``k == 1``."""
    k = kv_replication(num_heads, kv_BGSD.shape[head_dim], sp_size)
    return kv_BGSD if k == 1 else kv_BGSD.repeat_interleave(k, dim=head_dim)


def ulysses_attention(
    attn_fn: Callable[..., torch.Tensor],
    q_BHsD: torch.Tensor,
    k_BGsD: torch.Tensor,
    v_BGsD: torch.Tensor,
    *args: Any,
    group: SequenceGroup,
    **kwargs: Any,
) -> torch.Tensor:
    """``attn_fn(q, k, v, *args, **kwargs)`` over the whole row, from and to this rank's token shard.

    Args:
        attn_fn: an attention call of the models' shape (their shared ``attend``): ``q [B, H, S, Dq]``,
            ``k [B, G, S, Dq]``, ``v [B, G, S, Dv]`` -> ``[B, H, S, Dv]``; ``args``/``kwargs`` (the mask, built
            for the whole row; ``scale``; ``enable_gqa``) are passed through unchanged.
        q_BHsD, k_BGsD, v_BGsD: this rank's ``s`` tokens of every head (RoPE already applied at the whole row's
            positions).
        group: the sequence group (see :data:`SequenceGroup`); None or one rank: ``attn_fn`` runs as is.

    Returns:
        ``[B, H, s, Dv]``: this rank's tokens of every head, as ``attn_fn`` over the whole row gives them.
    """
    pg = as_process_group(group)
    if pg is None:
        return attn_fn(q_BHsD, k_BGsD, v_BGsD, *args, **kwargs)
    sp = dist.get_world_size(pg)
    H, G = q_BHsD.shape[1], k_BGsD.shape[1]
    if v_BGsD.shape[1] != G:
        raise ValueError(f"k has {G} heads and v {v_BGsD.shape[1]}; they must match")
    check_sequence_parallel(sp, num_heads=H, num_kv_heads=G)
    k_BGsD, v_BGsD = replicate_kv_heads(k_BGsD, H, sp), replicate_kv_heads(v_BGsD, H, sp)
    q_BhSD = sequence_to_heads(q_BHsD, pg)
    k_BgSD = sequence_to_heads(k_BGsD, pg)
    v_BgSD = sequence_to_heads(v_BGsD, pg)
    o_BhSD = attn_fn(q_BhSD, k_BgSD, v_BgSD, *args, **kwargs)
    return heads_to_sequence(o_BhSD, pg)


@dataclass(frozen=True)
class UlyssesAttention:
    """A drop-in for ``attn_fn`` where each rank of ``group`` holds a token shard: it runs on head shards.

    ``UlyssesAttention(attend, group)(q, k, v, mask, scale=...)``, see :func:`ulysses_attention`.

    Attributes:
        attn_fn: the attention call it wraps (the models' shape).
        group: the sequence group (see :data:`SequenceGroup`).
    """

    attn_fn: Callable[..., torch.Tensor]
    group: SequenceGroup

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """:func:`ulysses_attention` of ``attn_fn`` over ``group``."""
        return ulysses_attention(self.attn_fn, q, k, v, *args, group=self.group, **kwargs)
