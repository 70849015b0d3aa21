"""Triton kernels around the expert GEMM on CUDA: the gathers (a token's K routed copies read once each), SwiGLU.

# T tokens, K top-k, D hidden, N = T*K routed copies in expert order; inv[t*K+k] is the row of token t's k-th copy

Compiled (Inductor) versions of these ops index each element through the permutation: one index load per
element read. Here a program owns a token (and a block of D): it loads its K row indices once and then whole
rows, vectorised. Same arithmetic as the eager functions in ``moeshard.ep._kernels`` (products and sums in
float32). The kernel tier ``"triton"`` (``EPOptions(kernels="triton")``, see ``_kernels.kernels_for``) uses them
for CUDA tensors; everything else keeps the compiled kernels. The kernels also run under triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU tests check them.

SwiGLU's gated activation (``silu(gate) * up``) and its gradient are here too, as plain elementwise kernels in
float32: one launch, where a compiled kernel's call costs several times the host time (guards, the compiled
graph's wrapper), three times per layer right after the split-size sync, where the device waits for the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "SiluGated",
    "combine_backward",
    "expand_rows",
    "gated",
    "gather_sum",
    "silu_gated",
    "silu_gated_backward",
    "unsort_weighted_sum",
]

_BLOCK_D = 1024


@triton.jit
def _gather_sum_kernel(
    src_ptr, inv_ptr, w_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr
):
    # out[t] = Σ_k (w[t, k] ·) src[inv[t*K+k]], accumulated in float32
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        n = tl.load(inv_ptr + t * K + k).to(tl.int64)
        row = tl.load(src_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += row
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_rows_kernel(x_ptr, order_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    t = tl.load(order_ptr + n).to(tl.int64) // K
    tl.store(out_ptr + n * D + offs, tl.load(x_ptr + t * D + offs, mask=mask), mask=mask)


@triton.jit
def _combine_backward_kernel(
    g_ptr,
    y_ptr,
    inv_ptr,
    w_ptr,
    gy_ptr,
    gw_ptr,
    D: tl.constexpr,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NEED_GY: tl.constexpr,
    NEED_GW: tl.constexpr,
):
    # gy[inv[t*K+k]] = g[t] * w[t, k] (a permutation write: every row once, no atomics);
    # gw[t, k] = <y[inv[t*K+k]], g[t]>. The token's gradient row is read once per block of D.
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_POW2)
    dots = tl.zeros([K_POW2], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        g = tl.load(g_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            n = tl.load(inv_ptr + t * K + k).to(tl.int64)
            if NEED_GY:
                w = tl.load(w_ptr + t * K + k).to(tl.float32)
                tl.store(gy_ptr + n * D + offs, (g * w).to(gy_ptr.dtype.element_ty), mask=mask)
            if NEED_GW:
                y = tl.load(y_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
                dots += tl.where(ks == k, tl.sum(y * g, axis=0), 0.0)
    if NEED_GW:
        tl.store(gw_ptr + t * K + ks, dots, mask=ks < K)


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


def unsort_weighted_sum(
    y_sorted_ND: torch.Tensor, inv_N: torch.Tensor, w_TK: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``Σ_k w[t, k] · y_sorted[inv[t*K+k]]`` in float32, ``[T, D]``, stored in ``out_dtype`` (one rounding)."""
    T, K = w_TK.shape
    y_sorted_ND, inv_N = _check(y_sorted_ND, inv_N, K)
    D = y_sorted_ND.shape[1]
    out = torch.empty((T, D), dtype=out_dtype, device=y_sorted_ND.device)
    if T and D:
        grid = (T, triton.cdiv(D, _BLOCK_D))
        _gather_sum_kernel[grid](y_sorted_ND, inv_N, w_TK.contiguous(), out, D, K=K, BLOCK_D=_BLOCK_D, WEIGHTED=True)
    return out


def gather_sum(grad_ND: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """``Σ_k grad[inv[t*K+k]]`` (float32 sum, grad's dtype), ``[T, D]``."""
    grad_ND, inv_N = _check(grad_ND, inv_N, K)
    T, D = inv_N.numel() // K, grad_ND.shape[1]
    out = torch.empty((T, D), dtype=grad_ND.dtype, device=grad_ND.device)
    if T and D:
        grid = (T, triton.cdiv(D, _BLOCK_D))
        _gather_sum_kernel[grid](grad_ND, inv_N, grad_ND, out, D, K=K, BLOCK_D=_BLOCK_D, WEIGHTED=False)
    return out


def expand_rows(x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
    """``x[order // K]``: each token's row once per routed copy, in expert order, ``[N, D]``."""
    x_TD, order_N = _check(x_TD, order_N, K)
    N, D = order_N.numel(), x_TD.shape[1]
    out = torch.empty((N, D), dtype=x_TD.dtype, device=x_TD.device)
    if N and D:
        _expand_rows_kernel[(N, triton.cdiv(D, _BLOCK_D))](x_TD, order_N, out, D, K=K, BLOCK_D=_BLOCK_D)
    return out


def combine_backward(
    g_TD: torch.Tensor,
    y_sorted_ND: torch.Tensor,
    inv_N: torch.Tensor,
    w_TK: torch.Tensor,
    need_gy: bool,
    need_gw: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both gradients of :func:`unsort_weighted_sum` in one pass: ``(grad y_sorted, grad w)``.

    ``grad y_sorted[inv[t*K+k]] = g[t] · w[t, k]`` in y's dtype; ``grad w[t, k] = <y_sorted[inv[t*K+k]], g[t]>``
    in float32 (products in float32).
    """
    T, K = w_TK.shape
    y_sorted_ND, inv_N = _check(y_sorted_ND, inv_N, K)
    g_TD = g_TD.contiguous()
    D = y_sorted_ND.shape[1]
    gy = torch.empty_like(y_sorted_ND) if need_gy else None
    gw = torch.empty((T, K), dtype=torch.float32, device=g_TD.device) if need_gw else None
    if T and D and (need_gy or need_gw):
        block = min(triton.next_power_of_2(D), 4096)
        _combine_backward_kernel[(T,)](
            g_TD,
            y_sorted_ND,
            inv_N,
            w_TK.contiguous(),
            gy if need_gy else g_TD,
            gw if need_gw else g_TD,
            D,
            K=K,
            K_POW2=triton.next_power_of_2(K),
            BLOCK_D=block,
            NEED_GY=need_gy,
            NEED_GW=need_gw,
            num_warps=8,
        )
    return gy, gw
