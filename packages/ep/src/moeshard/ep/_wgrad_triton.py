"""The experts' weight gradients as one Triton grouped GEMM that can add into the gradient it is given.

# N rows grouped by local expert (cumulative ends ``offs_E``), E local experts, M and K the two weight dims

``out[e] = alpha * a[rows_e]^T @ b[rows_e]`` (``accumulate=False``) or ``out[e] += alpha * a[rows_e]^T @ b[rows_e]``
(``accumulate=True``), for every local expert ``e``, products summed in float32 and the old value added in float32
before the one rounding to ``out``'s dtype. An expert without rows gets zeros (or keeps its gradient).

Why: with gradient accumulation, torch's ``grouped_mm`` writes each micro-batch's weight gradient into a new tensor
and autograd then adds it to ``param.grad`` in a separate pass, reading both and writing one (1.2 GB per
Qwen3-30B-A3B layer). Here the GEMM's epilogue reads the old gradient once and writes the sum once.

A program owns one ``BLOCK_M x BLOCK_K`` tile of one expert's gradient and runs over that expert's rows in
``BLOCK_R`` steps (the reduction dimension is the rows: ``a`` and ``b`` are read row-major, ``a`` transposed in
registers). The expert is the grid's second axis, so the tiles of one expert run together and share its rows in L2.
Runs under triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors too, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CONFIGS", "grouped_weight_grad"]

CONFIGS: dict[str, dict[str, int]] = {
    "few_rows": {"BLOCK_M": 128, "BLOCK_K": 128, "BLOCK_R": 32, "num_warps": 4, "num_stages": 4},
    "many_rows": {"BLOCK_M": 128, "BLOCK_K": 256, "BLOCK_R": 64, "num_warps": 8, "num_stages": 3},
}
"""Tile shapes and launch parameters, by name. ``benchmarks/wgrad_gemm.py`` times them on a GPU: on one H200 at the
30B-A3B expert shapes, ``few_rows`` was the fastest at 256 rows per expert (micro-batch 1 of 4,096 tokens) and
``many_rows`` at 512 and more (``benchmarks/NOTES.md``)."""
FEW_ROWS = 384
"""Mean rows per expert up to which ``config=None`` picks ``few_rows``."""


@triton.jit
def _wgrad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    offs_ptr,
    M,
    K,
    stride_a,
    stride_b,
    alpha,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pm = pid // tiles_k
    pk = pid % tiles_k
    end = tl.load(offs_ptr + e).to(tl.int64)
    start = tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int64)
    start = tl.where(e > 0, start, 0)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_k = rk < K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        mask_r = rr < end
        a = tl.load(a_ptr + rr[:, None] * stride_a + rm[None, :], mask=mask_r[:, None] & mask_m[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * stride_b + rk[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    acc = acc * alpha
    out = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
    mask = mask_m[:, None] & mask_k[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def grouped_weight_grad(
    a_NM: torch.Tensor,
    b_NK: torch.Tensor,
    offs_E: torch.Tensor,
    out_EMK: torch.Tensor,
    *,
    accumulate: bool,
    alpha: float = 1.0,
    config: str | None = None,
) -> torch.Tensor:
    """``out[e] (+)= alpha * a[rows_e]^T @ b[rows_e]`` in place (see the module docstring); returns ``out_EMK``.

    ``a_NM`` and ``b_NK`` need unit stride in their last dim; ``offs_E`` holds each expert's cumulative row end
    (int32 or int64, on the rows' device, last entry <= N); ``out_EMK`` is contiguous ``[E, M, K]``. ``config``: a
    name of :data:`CONFIGS`; None picks by the mean rows per expert (no device sync: from the row count).
    """
    E, M, K = out_EMK.shape
    if a_NM.shape[1] != M or b_NK.shape[1] != K or a_NM.shape[0] != b_NK.shape[0] or offs_E.numel() != E:
        raise ValueError(
            f"grouped_weight_grad: a {tuple(a_NM.shape)}, b {tuple(b_NK.shape)}, {offs_E.numel()} offsets and out "
            f"{tuple(out_EMK.shape)} do not fit out[e] = a[rows_e]^T @ b[rows_e]"
        )
    if a_NM.stride(-1) != 1 or b_NK.stride(-1) != 1 or not out_EMK.is_contiguous():
        raise ValueError("grouped_weight_grad needs row-major a and b and a contiguous out")
    if E == 0:
        return out_EMK
    if config is None:
        config = "few_rows" if a_NM.shape[0] <= FEW_ROWS * E else "many_rows"
    cfg = dict(CONFIGS[config])
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]), E)
    _wgrad_kernel[grid](
        a_NM,
        b_NK,
        out_EMK,
        offs_E,
        M,
        K,
        a_NM.stride(0),
        b_NK.stride(0),
        float(alpha),
        ACCUMULATE=bool(accumulate),
        PRECISION="ieee" if a_NM.dtype == torch.float32 else "tf32",  # float32 operands: no tf32 rounding
        **cfg,
    )
    return out_EMK
