"""Triton kernels around the expert GEMM on CUDA: the gathers (a token's K routed copies read once each), SwiGLU.

# T tokens, K top-k, D hidden, N = T*K routed copies in expert order; inv[t*K+k] is the row of token t's k-th copy

Compiled (Inductor) versions of the gathers index each element through the permutation: one index load per
element read. Here a program owns a token (and a block of D): it loads its K row indices once and then whole
rows, vectorised. Same arithmetic as the eager functions in ``moeshard.ep._kernels`` (products and sums in
float32). The kernel tier ``"triton"`` (``EPOptions(kernels="triton")``, see ``_kernels.kernels_for``) uses them
for CUDA tensors; everything else keeps the compiled kernels. The kernels also run under triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU tests check them.

SwiGLU's gated activation (``silu(gate) * up``) and its gradient are here too, as plain elementwise kernels in
float32: one launch, where a compiled kernel's call costs several times the host time (guards, the compiled
graph's wrapper), three times per layer right after the split-size sync, where the device waits for the host.
The weighted one (``s[n] · silu(gate) · up``, a per-row weight such as the routing weight) is elementwise too; its
backward is row-tiled, as ``grad s`` is a sum over each row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "SiluGated",
    "expand_rows",
    "gated",
    "gather_sum",
    "silu_gated",
    "silu_gated_backward",
    "silu_weighted_gated",
    "silu_weighted_gated_backward",
]

_BLOCK_D = 1024


@triton.jit
def _gather_sum_kernel(src_ptr, inv_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr):
    # out[t] = Σ_k src[inv[t*K+k]], accumulated in float32, rounded once
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        n = tl.load(inv_ptr + t * K + k).to(tl.int64)
        row = tl.load(src_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
        acc += row
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_rows_kernel(x_ptr, inv_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr):
    # out[inv[t*K+k]] = x[t]: a program owns a token (and a block of D), reads its row once and writes its K copies
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    row = tl.load(x_ptr + t * D + offs, mask=mask)
    for k in tl.static_range(K):
        n = tl.load(inv_ptr + t * K + k).to(tl.int64)
        tl.store(out_ptr + n * D + offs, row, mask=mask)


@triton.jit
def _silu_gated_kernel(h_ptr, out_ptr, total, F: tl.constexpr, BLOCK: tl.constexpr):
    # out[n, f] = silu(h[n, f]) * h[n, F + f], in float32, rounded once
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    src = (i // F) * (2 * F) + i % F
    g = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + src + F, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_gated_backward_kernel(h_ptr, g_ptr, out_ptr, total, F: tl.constexpr, BLOCK: tl.constexpr):
    # out[n] = [grad·up·silu'(gate) | grad·silu(gate)], silu'(x) = s·(1 + x·(1 − s)), s = sigmoid(x)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    src = (i // F) * (2 * F) + i % F
    x = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + src + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(x)
    tl.store(out_ptr + src, (dy * u * sig * (1.0 + x * (1.0 - sig))).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + src + F, (dy * x * sig).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_weighted_gated_kernel(h_ptr, s_ptr, out_ptr, total, F: tl.constexpr, BLOCK: tl.constexpr):
    # out[n, f] = s[n] · silu(h[n, f]) · h[n, F + f], in float32, rounded once
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    n = i // F
    src = n * (2 * F) + i % F
    g = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + src + F, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (s * (g * tl.sigmoid(g) * u)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_weighted_gated_backward_kernel(
    h_ptr,
    g_ptr,
    s_ptr,
    gh_ptr,
    gs_ptr,
    a_ptr,
    N,
    F: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    NEED_A: tl.constexpr,
):
    # act = silu(gate)·up; gs[n] = Σ_f grad·act; gh[n] = [g·up·silu'(gate) | g·silu(gate)] with g = grad·s[n]
    # (float32, not rounded); a = s[n]·act (the forward's output) if NEED_A. A program owns BLOCK_R rows.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    s = tl.load(s_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    dots = tl.zeros([BLOCK_R], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        i = rows[:, None] * F + cols[None, :]
        src = rows[:, None] * (2 * F) + cols[None, :]
        x = tl.load(h_ptr + src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + src + F, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(x)
        act = x * sig * u
        dots += tl.sum(dy * act, axis=1)
        gs = dy * s
        tl.store(gh_ptr + src, (gs * u * sig * (1.0 + x * (1.0 - sig))).to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh_ptr + src + F, (gs * x * sig).to(gh_ptr.dtype.element_ty), mask=mask)
        if NEED_A:
            tl.store(a_ptr + i, (s * act).to(a_ptr.dtype.element_ty), mask=mask)
    tl.store(gs_ptr + rows, dots, mask=rmask)


_BLOCK_EW = 2048


def _check_gated(h_NX: torch.Tensor) -> tuple[torch.Tensor, int]:
    if h_NX.dim() != 2 or h_NX.shape[1] % 2:
        raise ValueError(f"expected h = [gate | up] of shape [N, 2F], got shape {tuple(h_NX.shape)}")
    return h_NX.contiguous(), h_NX.shape[1] // 2


def silu_gated(h_NX: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate | up]`` (``[N, 2F]`` → ``[N, F]``), computed in float32."""
    h_NX, F = _check_gated(h_NX)
    out = torch.empty((h_NX.shape[0], F), dtype=h_NX.dtype, device=h_NX.device)
    if out.numel():
        _silu_gated_kernel[(triton.cdiv(out.numel(), _BLOCK_EW),)](h_NX, out, out.numel(), F=F, BLOCK=_BLOCK_EW)
    return out


def silu_gated_backward(h_NX: torch.Tensor, grad_NF: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`silu_gated` with respect to ``h``, ``[N, 2F]`` in h's dtype (float32 arithmetic)."""
    h_NX, F = _check_gated(h_NX)
    if grad_NF.shape != (h_NX.shape[0], F):
        raise ValueError(f"grad has shape {tuple(grad_NF.shape)}, expected {(h_NX.shape[0], F)}")
    out = torch.empty_like(h_NX)
    total = grad_NF.numel()
    if total:
        grid = (triton.cdiv(total, _BLOCK_EW),)
        _silu_gated_backward_kernel[grid](h_NX, grad_NF.contiguous(), out, total, F=F, BLOCK=_BLOCK_EW)
    return out


def _check_weights(s_N: torch.Tensor, N: int) -> torch.Tensor:
    if s_N.shape != (N,):
        raise ValueError(f"expected per-row weights s of shape {(N,)}, got shape {tuple(s_N.shape)}")
    return s_N.contiguous()


def silu_weighted_gated(h_NX: torch.Tensor, s_N: torch.Tensor) -> torch.Tensor:
    """``s[:, None] * silu(gate) * up`` for ``h = [gate | up]`` (``[N, 2F]`` → ``[N, F]``), float32, one rounding."""
    h_NX, F = _check_gated(h_NX)
    s_N = _check_weights(s_N, h_NX.shape[0])
    out = torch.empty((h_NX.shape[0], F), dtype=h_NX.dtype, device=h_NX.device)
    if out.numel():
        grid = (triton.cdiv(out.numel(), _BLOCK_EW),)
        _silu_weighted_gated_kernel[grid](h_NX, s_N, out, out.numel(), F=F, BLOCK=_BLOCK_EW)
    return out


def _block_f(F: int) -> int:
    # the chunk of F a row-tiled program takes per step: a power of two up to 512, the least padding (F = 768: 256)
    if F <= 512:
        return triton.next_power_of_2(F)
    return min((512, 256, 128), key=lambda b: triton.cdiv(F, b) * b)


def silu_weighted_gated_backward(
    h_NX: torch.Tensor, grad_NF: torch.Tensor, s_N: torch.Tensor, need_a: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradients of :func:`silu_weighted_gated` in one pass: ``(grad h, grad s, a)``.

    ``grad h`` ``[N, 2F]`` in h's dtype (``grad · s`` kept in float32); ``grad s[n] = Σ_f grad · silu(gate) · up``
    in float32; ``a`` the forward's output, recomputed (the same bits), if ``need_a``, else None.
    """
    h_NX, F = _check_gated(h_NX)
    N = h_NX.shape[0]
    if grad_NF.shape != (N, F):
        raise ValueError(f"grad has shape {tuple(grad_NF.shape)}, expected {(N, F)}")
    s_N = _check_weights(s_N, N)
    grad_h = torch.empty_like(h_NX)
    a = torch.empty((N, F), dtype=h_NX.dtype, device=h_NX.device) if need_a else None
    if not (N and F):
        return grad_h, torch.zeros(N, dtype=torch.float32, device=h_NX.device), a
    grad_s = torch.empty(N, dtype=torch.float32, device=h_NX.device)
    block_f = _block_f(F)
    block_r = max(4, min(16, 4096 // block_f))
    _silu_weighted_gated_backward_kernel[(triton.cdiv(N, block_r),)](
        h_NX,
        grad_NF.contiguous(),
        s_N,
        grad_h,
        grad_s,
        a if need_a else grad_h,
        N,
        F=F,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        NEED_A=need_a,
        num_warps=8 if block_r * block_f >= 4096 else 4,
    )
    return grad_h, grad_s, a


class SiluGated(torch.autograd.Function):
    """:func:`silu_gated` under autograd (backward: :func:`silu_gated_backward`)."""

    @staticmethod
    def forward(ctx, h_NX: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(h_NX)
        return silu_gated(h_NX)

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor) -> torch.Tensor:  # noqa: D102
        (h_NX,) = ctx.saved_tensors
        return silu_gated_backward(h_NX, grad_NF)


def gated(h_NX: torch.Tensor) -> torch.Tensor:
    """:func:`silu_gated`, through :class:`SiluGated` where autograd records (the plain expert path); the bare
    kernel inside the hand-written expert passes, which record nothing."""
    if torch.is_grad_enabled() and h_NX.requires_grad:
        return SiluGated.apply(h_NX)
    return silu_gated(h_NX)


def _check(rows: torch.Tensor, index: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    if rows.dim() != 2:
        raise ValueError(f"expected a [rows, D] tensor, got shape {tuple(rows.shape)}")
    if index.dim() != 1 or index.numel() % K:
        raise ValueError(f"expected a 1-D index of T*K entries (K={K}), got shape {tuple(index.shape)}")
    return rows.contiguous(), index.contiguous()


def gather_sum(grad_ND: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """``Σ_k grad[inv[t*K+k]]`` (float32 sum, grad's dtype), ``[T, D]``."""
    grad_ND, inv_N = _check(grad_ND, inv_N, K)
    T, D = inv_N.numel() // K, grad_ND.shape[1]
    out = torch.empty((T, D), dtype=grad_ND.dtype, device=grad_ND.device)
    if T and D:
        grid = (T, triton.cdiv(D, _BLOCK_D))
        _gather_sum_kernel[grid](grad_ND, inv_N, out, D, K=K, BLOCK_D=_BLOCK_D)
    return out


def expand_rows(x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """``x[order // K]``: each token's row once per routed copy, in expert order, ``[N, D]``.

    Written token by token through the inverse ``inv_N`` (copy ``t*K+k`` goes to row ``inv[t*K+k]``): each row of
    ``x`` is read once, where a program per copy reads it K times (at T·D beyond the L2 cache, from memory each
    time: 2·N·D element moves instead of (T + N)·D). ``order_N`` only checks the shapes."""
    x_TD, inv_N = _check(x_TD, inv_N, K)
    if order_N.shape != inv_N.shape:
        raise ValueError(f"order and its inverse differ in shape: {tuple(order_N.shape)} and {tuple(inv_N.shape)}")
    N, D = inv_N.numel(), x_TD.shape[1]
    if N // K != x_TD.shape[0]:
        raise ValueError(f"expected {N // K} rows of x for {N} copies (K={K}), got {x_TD.shape[0]}")
    out = torch.empty((N, D), dtype=x_TD.dtype, device=x_TD.device)
    if N and D:
        _expand_rows_kernel[(N // K, triton.cdiv(D, _BLOCK_D))](x_TD, inv_N, out, D, K=K, BLOCK_D=_BLOCK_D)
    return out
