"""The route (the routed copies in expert order) as a counting sort in three triton kernels, on CUDA.

# T tokens, K top-k, E experts, N = T*K routed copies (copy n = t*K+k is token t's k-th), B blocks of copies

``route(ids_TK, E) -> (order_N, inv_N, counts_E)`` gives what ``sort_by_expert`` and ``inverse_permutation``
give (``moeshard.ep._permute``): the same stable order, because a copy's place is its expert's first row, plus the
copies of that expert in earlier blocks, plus those before it in its own block. The sort path runs about ten
launches for this (a cast, the radix sort's passes, ``searchsorted``, ``diff``, the inverse's scatter), forward and
again in a checkpointed layer's recompute; this is four launches (a zeroed histogram, count, scan, place) with no
temporary but the histogram, and less host time per layer (``docs/performance.md``). Integer arithmetic only: the
result equals the sort path's exactly. The kernels also run under triton's interpreter on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_EXPERTS", "route"]

_BLOCK = 64  # copies per program of the count and place kernels (the place kernel compares them pairwise)
_SCAN_TILE = 8192  # histogram entries per step of a scan program
_SCAN_PROGRAMS = 16  # the most programs of the scan (tiles of experts)
MAX_EXPERTS = _SCAN_TILE
"""The most experts the kernels take (a scan program holds rows of its tile of experts, at most 16 tiles); more go
the sort path."""


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, N, E: tl.constexpr, BLOCK: tl.constexpr):
    # hist[b, e] = copies of expert e in block b (atomic adds into this program's own row: order-free, exact)
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < N, other=0).to(tl.int32)
    valid = (offs < N) & (ids >= 0) & (ids < E)  # an id out of range is left out, never written out of bounds
    tl.atomic_add(hist_ptr + b * E + ids, tl.full([BLOCK], 1, tl.int32), mask=valid)


@triton.jit
def _scan_kernel(hist_ptr, counts_ptr, first_ptr, NB, E: tl.constexpr, TILE_E: tl.constexpr, ROWS: tl.constexpr):
    # Program p takes the experts [p*TILE_E, (p+1)*TILE_E): hist[b, e] becomes the copies of expert e in blocks
    # before b, counts[e] the total (int64). first[e] (zeroed) becomes the sorted position of expert e's first copy
    # by atomic adds: this tile's copies of the experts before e, and every earlier tile's total, which that tile's
    # program adds to each later expert (integers: order-free, exact).
    p = tl.program_id(0)
    experts = p * TILE_E + tl.arange(0, TILE_E)
    in_e = experts < E
    carry = tl.zeros([TILE_E], dtype=tl.int32)
    for start in range(0, NB, ROWS):
        rows = start + tl.arange(0, ROWS)
        mask = (rows < NB)[:, None] & in_e[None, :]
        ptrs = hist_ptr + rows[:, None] * E + experts[None, :]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=mask)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + experts, carry.to(tl.int64), mask=in_e)
    tl.atomic_add(first_ptr + experts, tl.cumsum(carry, axis=0) - carry, mask=in_e)
    total = tl.zeros([TILE_E], dtype=tl.int32) + tl.sum(carry, axis=0)
    for start in range((p + 1) * TILE_E, E, TILE_E):
        later = start + tl.arange(0, TILE_E)
        tl.atomic_add(first_ptr + later, total, mask=later < E)


@triton.jit
def _place_kernel(ids_ptr, base_ptr, first_ptr, order_ptr, inv_ptr, N, E: tl.constexpr, BLOCK: tl.constexpr):
    # inv[n] = first[e] + base[b, e] + (copies of e before n in block b), for e = ids[n]; order[inv[n]] = n
    b = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    offs = b * BLOCK + lane
    valid = offs < N
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    valid = valid & (ids >= 0) & (ids < E)
    earlier = (ids[None, :] == ids[:, None]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    e = tl.where(valid, ids, 0)
    dest = tl.load(first_ptr + e, mask=valid, other=0) + tl.load(base_ptr + b * E + e, mask=valid, other=0) + rank
    dest = dest.to(tl.int64)
    tl.store(inv_ptr + offs, dest, mask=valid)
    tl.store(order_ptr + dest, offs.to(tl.int64), mask=valid)


def scan_tile(num_experts: int) -> int:
    """Experts per program of the scan: at least 8 (32-byte rows of the histogram), at most 16 programs."""
    return max(8, triton.next_power_of_2(num_experts) // _SCAN_PROGRAMS)


def route(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order_N, inv_N, counts_E)`` of the copies ``topk_ids_TK`` (expert ids in ``[0, num_experts)``).

    ``order_N``: the copy indices ``t*K+k`` in expert order, stably (int64); ``inv_N``: its inverse (the sorted
    row of each copy, int64); ``counts_E``: copies per expert (int64). No device→host sync.

    Raises:
        ValueError: more than :data:`MAX_EXPERTS` experts (use the sort path).
    """
    E = num_experts
    if E > MAX_EXPERTS:
        raise ValueError(f"the triton route takes up to {MAX_EXPERTS} experts, got {E}; route with sort_by_expert")
    ids_N = topk_ids_TK.reshape(-1).contiguous()
    N, dev = ids_N.numel(), ids_N.device
    order_N = torch.empty(N, dtype=torch.int64, device=dev)
    inv_N = torch.empty(N, dtype=torch.int64, device=dev)
    counts_E = torch.empty(E, dtype=torch.int64, device=dev)
    NB = triton.cdiv(N, _BLOCK)
    zeroed = torch.zeros(NB * E + E, dtype=torch.int32, device=dev)  # the histogram and first, one memset
    hist_BE, first_E = zeroed[: NB * E].view(NB, E), zeroed[NB * E :]
    if N:
        _count_kernel[(NB,)](ids_N, hist_BE, N, E=E, BLOCK=_BLOCK)
    tile_e = scan_tile(E)
    _scan_kernel[(triton.cdiv(E, tile_e),)](
        hist_BE, counts_E, first_E, NB, E=E, TILE_E=tile_e, ROWS=max(1, _SCAN_TILE // tile_e)
    )
    if N:
        _place_kernel[(NB,)](ids_N, hist_BE, first_E, order_N, inv_N, N, E=E, BLOCK=_BLOCK)
    return order_N, inv_N, counts_E
