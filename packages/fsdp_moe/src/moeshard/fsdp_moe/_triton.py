"""Triton kernels of :class:`LocalExpertAdamW` (CUDA; see ``_local_adamw``): the AdamW pass,
and the sum of squares of compute-dtype gradients for the clipping norm. (The kernels of the float32 gradients FSDP2
holds are in ``_grad_triton``.)

The update:
per element, the gradient read in its stored dtype (the compute dtype as autograd left it in ``param.grad``, or
float32) and multiplied by the divide factor and the clip coefficient, the float32 master, both moments; written:
the master, both moments and, if given, the compute-dtype parameter. The arithmetic is torch's for-loop AdamW in
float32 (``_single_tensor_adam``): decay, ``lerp`` of the first moment, the second moment,
``denom = sqrt(v) / sqrt(bias_correction2) + eps``, the step. (An optional ``grad_scale`` divides the gradient as
torch's fused kernel does; the optimizer passes none.) The kernels also run under triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["adamw_update", "adamw_update_split", "sum_of_squares"]

_BLOCK = 1024  # faster than 2048 for bf16 and fp32 gradients alike (docs/performance.md)
_NORM_BLOCK = 8192


@triton.jit
def _scaled_grad(g_ptr, mult_ptr, offs, mask, g_scale, HAS_MULT: tl.constexpr):
    # the gradient in float32, times the divide factor and (HAS_MULT) the clip coefficient read on the device
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * g_scale
    if HAS_MULT:
        g = g * tl.load(mult_ptr)
    return g


@triton.jit
def _adamw_update(
    p,
    g,
    m_ptr,
    v_ptr,
    offs,
    mask,
    decay,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
):
    # torch's for-loop AdamW in float32: decay, the first moment's lerp (weight below 0.5), the second moment, the
    # step; the moments read and written here, the new master returned. Both kernels below, so a master held split
    # moves as a float32 one, bit for bit.
    m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    return p - step_size * (m / denom)


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    copy_ptr,
    mult_ptr,
    gs_ptr,
    n,
    g_scale,
    decay,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
    HAS_COPY: tl.constexpr,
    HAS_MULT: tl.constexpr,
    HAS_GS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = _scaled_grad(g_ptr, mult_ptr, offs, mask, g_scale, HAS_MULT)
    if HAS_GS:
        g = g / tl.load(gs_ptr)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    p = _adamw_update(
        p, g, m_ptr, v_ptr, offs, mask, decay, beta2, one_minus_beta1, one_minus_beta2, step_size,
        bias_correction2_sqrt, eps,
    )  # fmt: skip
    tl.store(p_ptr + offs, p, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    copy: torch.Tensor | None,
    grad_mul: float,
    mult: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    step_size: float,
    bias_correction2_sqrt: float,
    eps: float,
) -> None:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (float32, contiguous, same shape) in place from ``grad ·
    grad_mul · mult / grad_scale``, and write ``param`` cast into ``copy`` when given."""
    n = param.numel()
    for t in (grad, exp_avg, exp_avg_sq) + ((copy,) if copy is not None else ()):
        assert t.numel() == n and t.is_contiguous() and t.device == param.device, (t.shape, param.shape)
    assert param.dtype == exp_avg.dtype == exp_avg_sq.dtype == torch.float32 and param.is_contiguous()
    if n == 0:
        return
    device = param.device
    mult = mult.to(device=device, dtype=torch.float32) if mult is not None else None
    grad_scale = grad_scale.to(device=device, dtype=torch.float32) if grad_scale is not None else None
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        copy if copy is not None else param,
        mult if mult is not None else param,
        grad_scale if grad_scale is not None else param,
        n,
        float(grad_mul),
        float(decay),
        float(beta2),
        float(1 - beta1),
        float(1 - beta2),
        float(step_size),
        float(bias_correction2_sqrt),
        float(eps),
        HAS_COPY=copy is not None,
        HAS_MULT=mult is not None,
        HAS_GS=grad_scale is not None,
        BLOCK=_BLOCK,
        num_warps=8,
    )


@triton.jit
def _split_adamw_kernel(
    hi_ptr,
    lo_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    mult_ptr,
    n,
    g_scale,
    decay,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    step_size,
    bias_correction2_sqrt,
    eps,
    HAS_MULT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # _adamw_kernel's update of a master held split (``_adamw_step.split_master``): read as the high and low 16 bits
    # of its float32 bits (int16 each, sign-extended: the shift drops the extension), written back split, the high
    # half rounded to nearest with ties away from zero.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = _scaled_grad(g_ptr, mult_ptr, offs, mask, g_scale, HAS_MULT)
    hi = tl.load(hi_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    lo = tl.load(lo_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    p = _adamw_update(
        p, g, m_ptr, v_ptr, offs, mask, decay, beta2, one_minus_beta1, one_minus_beta2, step_size,
        bias_correction2_sqrt, eps,
    )  # fmt: skip
    bits = p.to(tl.int32, bitcast=True)
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    tl.store(hi_ptr + offs, hi.to(tl.int16), mask=mask)
    tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)


def adamw_update_split(
    hi: torch.Tensor,
    lo: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad_mul: float,
    mult: torch.Tensor | None,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    step_size: float,
    bias_correction2_sqrt: float,
    eps: float,
) -> None:
    """:func:`adamw_update` of a float32 master held split: ``hi`` (bf16, the parameter) and ``lo`` (int16) in
    place, with the moments; the same float32 arithmetic, so the same masters bit for bit. 26 bytes per element
    with a bf16 gradient, where the float32 master and its bf16 copy take 28."""
    n = hi.numel()
    for t in (lo, grad, exp_avg, exp_avg_sq):
        assert t.numel() == n and t.is_contiguous() and t.device == hi.device, (t.shape, hi.shape)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16 and hi.is_contiguous()
    assert exp_avg.dtype == exp_avg_sq.dtype == torch.float32
    if n == 0:
        return
    mult = mult.to(device=hi.device, dtype=torch.float32) if mult is not None else None
    _split_adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        hi.view(torch.int16),
        lo,
        grad,
        exp_avg,
        exp_avg_sq,
        mult if mult is not None else exp_avg,
        n,
        float(grad_mul),
        float(decay),
        float(beta2),
        float(1 - beta1),
        float(1 - beta2),
        float(step_size),
        float(bias_correction2_sqrt),
        float(eps),
        HAS_MULT=mult is not None,
        BLOCK=_BLOCK,
        num_warps=8,
    )


@triton.jit
def _sum_of_squares_kernel(x_ptr, out_ptr, mult_ptr, n, factor, HAS_MULT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    block = tl.sum(x * x, axis=0) * factor
    if HAS_MULT:
        m = tl.load(mult_ptr)
        block = block * (m * m)
    tl.store(out_ptr + tl.program_id(0), block)


def sum_of_squares(tensors: list[torch.Tensor], factors: list[float], mults: list[torch.Tensor | None]) -> torch.Tensor:
    """``Σ_i factor_i · mult_i² · Σ x_i²`` over contiguous tensors in float32 (a float32 scalar tensor): one
    kernel per tensor writes its block sums into one buffer, then one sum.

    ``torch._foreach_norm`` reads a bf16 tensor well below the memory bound; this reads at it.
    """
    blocks = [triton.cdiv(t.numel(), _NORM_BLOCK) for t in tensors]
    device = tensors[0].device
    partial = torch.zeros(max(sum(blocks), 1), dtype=torch.float32, device=device)
    at = 0
    for t, b, factor, mult in zip(tensors, blocks, factors, mults, strict=True):
        assert t.is_contiguous() and t.device == device, (t.stride(), t.device)
        if b:
            m = mult.to(device=device, dtype=torch.float32) if mult is not None else partial
            _sum_of_squares_kernel[(b,)](
                t,
                partial[at:],
                m,
                t.numel(),
                float(factor),
                HAS_MULT=mult is not None,
                BLOCK=_NORM_BLOCK,
                num_warps=8,
            )
        at += b
    return partial.sum()
