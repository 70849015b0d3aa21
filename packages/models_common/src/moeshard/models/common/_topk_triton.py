"""Row-wise top-k of ``[N, E]`` scores in Triton, by k rounds of (maximum, lowest index holding it): each row's
selected ids (:func:`topk_ids`, the routers' selection), or only the selection counted per expert
(:func:`topk_counts`, the load-balancing loss).

# N rows (tokens), E experts, K selected per row

On CUDA ``torch.topk`` over 128 experts is a radix select per row and a sort of the selected (for the routers'
selection per layer, and for the load-balancing loss's over all layers' rows, then a scatter of the ids). Here one
program takes a block of rows
into registers and selects each row's K largest in K rounds; the scores are read once.

The selection is ``torch.topk``'s on CUDA: every value above the K-th largest, then values equal to it in index
order (its ``gatherTopK`` fills the ties it needs with the first ones it sees). :func:`topk_ids` lists a row's ids
by value, descending, equal values by index; ``torch.topk`` sorts its selection by value too, with an order among
equal values of its own. NaN ranks above every value, as in ``torch.topk``, and a row of ``-inf`` values still
gives k distinct ids.
Both functions also run under triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU
tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.models.common._topk import KERNEL_MAX_EXPERTS as MAX_EXPERTS
from moeshard.models.common._topk import KERNEL_MAX_TOP_K as MAX_TOP_K
from moeshard.models.common._topk import kernel_takes
from moeshard.models.common._weighted_counts import COUNT_LANES

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "topk_counts", "topk_ids", "topk_ids_op"]

_BLOCK_N = 64
_BLOCK_ELEMENTS = 8192


@triton.jit
def _take_largest(x, free, cols, BLOCK_E: tl.constexpr):
    # One round: each row's largest value among its free columns, the lowest index holding it, and the free columns
    # without it. Free columns only: a row of -inf values still gives K distinct columns of its own.
    masked = tl.where(free, x, float("-inf"))
    top = tl.max(masked, axis=1)
    first = tl.min(tl.where(free & (masked == top[:, None]), cols[None, :], BLOCK_E), axis=1)
    return first, free & (cols[None, :] != first[:, None])


@triton.jit
def _load_rows(scores_ptr, pid, N, E, stride, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    # The program's block of rows in float32 (exact: the 16-bit values' order and ties are kept), NaN as +inf (ranked
    # first, as torch.topk ranks it), and which columns are free: the row's E, none outside the rows.
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    inside = rows < N
    free = inside[:, None] & (cols < E)[None, :]
    x = tl.load(scores_ptr + rows[:, None] * stride + cols[None, :], mask=free, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    return x, free, rows, cols, inside


@triton.jit
def _topk_counts_kernel(probs_ptr, weight_ptr, counts_ptr, N, E, stride, K: tl.constexpr, LANES: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    x, free, rows, cols, inside = _load_rows(probs_ptr, pid, N, E, stride, BLOCK_N, BLOCK_E)
    chosen = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.int32)
    for _ in tl.static_range(K):
        first, free = _take_largest(x, free, cols, BLOCK_E)
        chosen = tl.where(cols[None, :] == first[:, None], 1, chosen)
    weight = tl.load(weight_ptr + rows, mask=inside, other=0.0)
    per_expert = tl.sum(tl.where(chosen != 0, weight[:, None], 0.0), axis=0)
    tl.atomic_add(counts_ptr + (pid % LANES) * E + cols, per_expert, mask=cols < E)


@triton.jit
def _topk_ids_kernel(scores_ptr, ids_ptr, N, E, stride, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_E: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    x, free, rows, cols, inside = _load_rows(scores_ptr, pid, N, E, stride, BLOCK_N, BLOCK_E)
    for k in tl.static_range(K):
        first, free = _take_largest(x, free, cols, BLOCK_E)
        tl.store(ids_ptr + rows * K + k, first.to(tl.int64), mask=inside)


def _check(scores_NE: torch.Tensor, top_k: int, name: str) -> None:
    if scores_NE.dim() != 2:
        raise ValueError(f"{name}: scores must be [N, E], got {tuple(scores_NE.shape)}")
    e = scores_NE.shape[1]
    if not kernel_takes(e, top_k):
        raise ValueError(
            f"{name} takes 1 <= top_k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got top_k={top_k} and E={e}"
        )


def _blocks(e: int) -> tuple[int, int]:
    """(rows, columns) of a program's block: the experts padded to a power of two, ~8k values in registers."""
    block_e = triton.next_power_of_2(e)
    return min(_BLOCK_N, max(1, _BLOCK_ELEMENTS // block_e)), block_e


def topk_ids(scores_NE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Int64 ``[N, top_k]``: each row's ``top_k`` largest scores' columns, by value descending, equal values by
    index; the set ``torch.topk`` selects on CUDA (module docstring). 16- or 32-bit scores, on CUDA, or on CPU under
    triton's interpreter.

    Raises:
        ValueError: not ``[N, E]``, more than :data:`MAX_EXPERTS` experts, or ``top_k`` not in
            1..min(E, :data:`MAX_TOP_K`)."""
    _check(scores_NE, top_k, "topk_ids")
    scores_NE = scores_NE if scores_NE.stride(-1) == 1 else scores_NE.contiguous()
    n, e = scores_NE.shape
    ids = torch.empty((n, top_k), dtype=torch.int64, device=scores_NE.device)
    block_n, block_e = _blocks(e)
    if n:
        _topk_ids_kernel[(triton.cdiv(n, block_n),)](
            scores_NE, ids, n, e, scores_NE.stride(0), K=top_k, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=4
        )
    return ids


@torch.library.custom_op("moeshard::topk_ids", mutates_args=())
def topk_ids_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_ids` as the custom op ``moeshard::topk_ids``, opaque to ``torch.compile``: what the routers call
    inside the compiled attention half (a launch there breaks no graph; the kept ops are called the same way)."""
    return topk_ids(scores, k)


@topk_ids_op.register_fake
def _(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int64)


def topk_counts(probs_NE: torch.Tensor, weight_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """Float32 ``[E]``: for each expert, the sum of ``weight_N`` over the rows whose ``top_k`` largest probabilities
    hold it (:func:`topk_ids`' selection, without the ids). With weights of 0 and 1 (a padding mask) these are
    ``torch.topk``'s ids counted, exactly. 16- or 32-bit probabilities, on CUDA, or on CPU under triton's
    interpreter.

    Raises:
        ValueError: not ``[N, E]`` and ``[N]``, more than :data:`MAX_EXPERTS` experts, or ``top_k`` not in
            1..min(E, :data:`MAX_TOP_K`)."""
    _check(probs_NE, top_k, "topk_counts")
    if weight_N.shape != probs_NE.shape[:1]:
        raise ValueError(f"topk_counts: weight must be [N], got {tuple(weight_N.shape)} for {tuple(probs_NE.shape)}")
    probs_NE = probs_NE if probs_NE.stride(-1) == 1 else probs_NE.contiguous()
    n, e = probs_NE.shape
    partial = torch.zeros(COUNT_LANES * e, dtype=torch.float32, device=probs_NE.device)
    block_n, block_e = _blocks(e)
    if n:
        _topk_counts_kernel[(triton.cdiv(n, block_n),)](
            probs_NE,
            weight_N.to(torch.float32).contiguous(),
            partial,
            n,
            e,
            probs_NE.stride(0),
            K=top_k,
            LANES=COUNT_LANES,
            BLOCK_N=block_n,
            BLOCK_E=block_e,
            num_warps=4,
        )
    return partial.view(COUNT_LANES, e).sum(0)
