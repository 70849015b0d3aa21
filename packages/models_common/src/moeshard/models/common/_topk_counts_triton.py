"""The load-balancing loss's expert counts in one Triton kernel: each row's top-k of ``[N, E]`` probabilities,
counted per expert, without the ids.

# N rows (tokens of every MoE layer), E experts, K selected per row

transformers' loss takes ``torch.topk`` of the probabilities and adds a one per selected expert. On CUDA that is a
radix select per row, a sort of the selected and a scatter of ``N·K`` ones into E counters (for 8 layers of 16,384
tokens and 128 experts, one H200's trace: 0.91, 0.11 and 0.30 ms per step). Here one program takes a block of rows
into registers, selects each row's K largest by K rounds of (maximum, lowest index holding it), and adds the
selected rows' weights per expert: one read of the probabilities (33.5 MB there) and a few thousand atomic adds.

The selection is ``torch.topk``'s on CUDA: every value above the K-th largest, then values equal to it in index
order (its ``gatherTopK`` fills the ties it needs with the first ones it sees), so the counts are the same whole
numbers. Rows whose probabilities hold a NaN count nothing (``torch.topk`` would rank NaN first). :func:`topk_counts`
also runs under triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.models.common._expert_load import COUNT_LANES

__all__ = ["topk_counts"]

_BLOCK_N = 64
_BLOCK_ELEMENTS = 8192
MAX_EXPERTS = 1024
"""The most experts :func:`topk_counts` takes (a row of ``[BLOCK_N, E]`` lives in registers)."""
MAX_TOP_K = 32
"""The largest ``top_k`` it takes (one unrolled round per selected expert)."""


@triton.jit
def _topk_counts_kernel(probs_ptr, weight_ptr, counts_ptr, N, E, stride, K: tl.constexpr, LANES: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    inside = rows < N
    cols_in = cols < E
    x = tl.load(
        probs_ptr + rows[:, None] * stride + cols[None, :],
        mask=inside[:, None] & cols_in[None, :],
        other=float("-inf"),
    ).to(tl.float32)  # exact: the order and the ties of the 16-bit values are kept
    chosen = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.int32)
    for _ in tl.static_range(K):
        top = tl.max(x, axis=1)
        first = tl.min(tl.where(x == top[:, None], cols[None, :], BLOCK_E), axis=1)  # the lowest index holding it
        pick = cols[None, :] == first[:, None]
        chosen = tl.where(pick, 1, chosen)
        x = tl.where(pick, float("-inf"), x)
    weight = tl.load(weight_ptr + rows, mask=inside, other=0.0)
    per_expert = tl.sum(tl.where(chosen != 0, weight[:, None], 0.0), axis=0)
    tl.atomic_add(counts_ptr + (pid % LANES) * E + cols, per_expert, mask=cols_in)


def topk_counts(probs_NE: torch.Tensor, weight_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """Float32 ``[E]``: for each expert, the sum of ``weight_N`` over the rows whose ``top_k`` largest probabilities
    hold it; ties at the k-th value go to the lower indices, as ``torch.topk`` on CUDA fills them. With weights of 0
    and 1 (a padding mask) these are ``torch.topk``'s ids counted, exactly. ``probs_NE`` 16- or 32-bit, on CUDA, or
    on CPU under triton's interpreter.

    Raises:
        ValueError: not ``[N, E]`` and ``[N]``, more than :data:`MAX_EXPERTS` experts, or ``top_k`` not in
            1..min(E, :data:`MAX_TOP_K`)."""
    if probs_NE.dim() != 2 or weight_N.shape != probs_NE.shape[:1]:
        raise ValueError(
            f"probs must be [N, E] and weight [N], got {tuple(probs_NE.shape)} and {tuple(weight_N.shape)}"
        )
    n, e = probs_NE.shape
    if e > MAX_EXPERTS or not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(
            f"topk_counts takes 1 <= top_k <= min(E, {MAX_TOP_K}) and E <= {MAX_EXPERTS}, got top_k={top_k} and E={e}"
        )
    probs_NE = probs_NE if probs_NE.stride(-1) == 1 else probs_NE.contiguous()
    partial = torch.zeros(COUNT_LANES * e, dtype=torch.float32, device=probs_NE.device)
    block_e = triton.next_power_of_2(e)
    block_n = min(_BLOCK_N, max(1, _BLOCK_ELEMENTS // block_e))  # a block of rows of ~8k values in registers
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
