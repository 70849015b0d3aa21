"""Triton kernels of :class:`~moeshard.fsdp_moe.LocalExpertAdamW` (CUDA; see ``_local_adamw``): the AdamW pass,
and the sum of squares of compute-dtype gradients for the clipping norm; and the float32 accumulation of a unit's
compute-dtype gradients (:func:`add_into_float32`, see ``_reduced_grad.grouped_grad_accumulation``), a scaled
float32 gradient added into a held one (:func:`scaled_add_`, see ``_reduced_grad.ReducedGrad.add_``) and one scaled
in place unless its factor is one (:func:`scale_`).

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

import functools

import torch
import triton
import triton.language as tl

__all__ = ["add_into_float32", "adamw_update", "adamw_update_split", "scale_", "scaled_add_", "sum_of_squares"]

_BLOCK = 1024  # 4.4 / 4.1 TB/s on an H200 (bf16 / fp32 gradients), 2048: 4.1 / 3.9 (expert_update_kernel.py)
_NORM_BLOCK = 8192
_ADD_BLOCK = 4096


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

    ``torch._foreach_norm`` reads a bf16 tensor at ~2 TB/s on an H200; this reads at the memory bound.
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


@triton.jit
def _add_into_float32_kernel(table_ptr, n_tensors, HALF: tl.constexpr, T_POW2: tl.constexpr, BLOCK: tl.constexpr):
    # table (int64): destination addresses, source addresses, element counts, each tensor's first block
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, T_POW2)
    first = tl.load(table_ptr + 3 * n_tensors + idx, mask=idx < n_tensors, other=2**62)
    i = tl.sum((first <= pid).to(tl.int32), axis=0) - 1
    dst = tl.load(table_ptr + i).to(tl.pointer_type(tl.float32))
    if HALF:
        src = tl.load(table_ptr + n_tensors + i).to(tl.pointer_type(tl.float16))
    else:
        src = tl.load(table_ptr + n_tensors + i).to(tl.pointer_type(tl.bfloat16))
    n = tl.load(table_ptr + 2 * n_tensors + i)
    offs = (pid - tl.load(table_ptr + 3 * n_tensors + i)) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    acc = tl.load(dst + offs, mask=inside)
    tl.store(dst + offs, acc + tl.load(src + offs, mask=inside).to(tl.float32), mask=inside)


def add_into_float32(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst += src`` for each pair (float32 ``dst``, bfloat16 or float16 ``src`` of its shape, both contiguous, one
    device): one vectorised kernel per source dtype over all pairs. Torch adds a 16-bit tensor into a float32 one
    with an unvectorised mixed-dtype kernel, one launch per tensor. The tensors' addresses go to the device in one
    small table (a non-blocking copy from pinned memory on CUDA)."""
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        ok = d.dtype == torch.float32 and s.dtype in (torch.bfloat16, torch.float16) and d.shape == s.shape
        if not (ok and d.is_contiguous() and s.is_contiguous() and d.device == s.device == dsts[0].device):
            raise ValueError(
                f"add_into_float32 adds contiguous 16-bit tensors into float32 ones of their shape on one device, got "
                f"{s.dtype} {tuple(s.shape)} into {d.dtype} {tuple(d.shape)}"
            )
        if d.numel():
            by_dtype.setdefault(s.dtype, []).append((d, s))
    for dtype, pairs in by_dtype.items():
        blocks = [triton.cdiv(d.numel(), _ADD_BLOCK) for d, _ in pairs]
        firsts = [sum(blocks[:i]) for i in range(len(blocks))]
        rows = [[d.data_ptr() for d, _ in pairs], [s.data_ptr() for _, s in pairs], [d.numel() for d, _ in pairs]]
        device = pairs[0][0].device
        table = torch.tensor(
            [*rows[0], *rows[1], *rows[2], *firsts], dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        table = table.to(device, non_blocking=True)
        _add_into_float32_kernel[(sum(blocks),)](
            table,
            len(pairs),
            HALF=dtype == torch.float16,
            T_POW2=triton.next_power_of_2(len(pairs)),
            BLOCK=_ADD_BLOCK,
            num_warps=8,
        )


@triton.jit
def _scaled_add_kernel(acc_ptr, g_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    factor = tl.load(factor_ptr).to(tl.float32)
    acc = tl.load(acc_ptr + offs, mask=inside)
    g = tl.load(g_ptr + offs, mask=inside)
    tl.store(acc_ptr + offs, acc + g * factor, mask=inside)


def scaled_add_(acc: torch.Tensor, g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``acc += g * factor`` in one pass (float32 ``acc`` and ``g`` of one shape, contiguous; ``factor`` a
    one-element tensor read on the device): a float32 gradient handed over, scaled, added to the one FSDP2 holds
    from earlier micro-batches (the LM head's). Eager torch needs two passes for it (``g *= factor`` vectorised, then
    the add; ``addcmul`` with a one-element device tensor broadcasts and is not vectorised): 6.2 against 3.7 GB per
    micro-batch at the ``[V, D]`` head of Qwen3-30B-A3B. Runs on CUDA tensors, or on CPU ones under triton's
    interpreter (the tests)."""
    if acc.dtype != torch.float32 or g.dtype != torch.float32 or acc.shape != g.shape or factor.numel() != 1:
        raise ValueError(
            f"scaled_add_ needs float32 acc and g of one shape and a one-element factor, got {acc.dtype} "
            f"{tuple(acc.shape)}, {g.dtype} {tuple(g.shape)} and {factor.numel()} factor elements"
        )
    if not (acc.is_contiguous() and g.is_contiguous()):
        raise ValueError("scaled_add_ needs contiguous acc and g")
    n = acc.numel()
    if n:
        _scaled_add_kernel[(triton.cdiv(n, _ADD_BLOCK),)](acc, g, factor, n, BLOCK=_ADD_BLOCK, num_warps=8)
    return acc


@triton.jit
def _scale_kernel(x_ptr, factor_ptr, n, blocks, BLOCK: tl.constexpr):
    # Every program reads the factor first and has nothing to do where it is one; else blocks pid, pid + P, ...
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        zero = tl.program_id(0).to(tl.int64) * 0  # int64 offsets (the interpreter's loop variable is a Python int)
        for b in range(tl.program_id(0), blocks, tl.num_programs(0)):
            offs = (zero + b) * BLOCK + tl.arange(0, BLOCK)
            inside = offs < n
            x = tl.load(x_ptr + offs, mask=inside)
            tl.store(x_ptr + offs, (x.to(tl.float32) * factor).to(x_ptr.dtype.element_ty), mask=inside)


def _programs(device: torch.device) -> int:
    """One wave of 8-warp programs: 8 per SM on CUDA (a fixed 8 in the interpreter)."""
    if device.type != "cuda":
        return 8
    return 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def scale_(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x *= factor`` in place (contiguous ``x``; ``factor`` a one-element tensor read on the device, the product
    taken in float32), and no pass over ``x`` where ``factor`` is one: one wave of programs that each read the
    factor and, unless it is one, scale their blocks. A gradient that already holds its scale (the LM head's,
    which folds the loss's divisor into its logit gradient) then costs one launch instead of a read and a write of
    ``x`` (1.24 GB at the float32 ``[V, D]`` head of Qwen3-30B-A3B, ~0.6 ms on one H200). Runs on CUDA tensors, or on
    CPU ones under triton's interpreter (the tests)."""
    if factor.numel() != 1 or not x.is_contiguous():
        raise ValueError(
            f"scale_ needs a contiguous tensor and a one-element factor, got {factor.numel()} factor elements and a "
            f"{'contiguous' if x.is_contiguous() else 'non-contiguous'} tensor"
        )
    n = x.numel()
    if n:
        blocks = triton.cdiv(n, _ADD_BLOCK)
        _scale_kernel[(min(blocks, _programs(x.device)),)](x, factor, n, blocks, BLOCK=_ADD_BLOCK, num_warps=8)
    return x
