"""LM head + next-token cross-entropy without materialising the ``[tokens, vocab]`` logits.

# N tokens, D hidden, V vocabulary, C tokens per chunk

With a 151,936-word vocabulary the plain path holds bf16 logits, their fp32 copy and log-softmax (~5 + 10 + 10
GB at 16k tokens) and makes several memory-bound passes over them. Here the tokens go through the head in chunks;
each chunk's fp32 logits live only while its loss and its gradient (softmax − one-hot) are computed, in the
forward. The gradients w.r.t. the hidden states and the head weight are kept (``[N, D]`` and ``[V, D]``) and
scaled by the incoming gradient in backward, so no logits are recomputed: the same three matmuls as the plain
path, numerically the same function (fp32 log-softmax of the logits in the compute dtype).

The loss's divisor is folded into those gradients where the logits are bfloat16 or float32: each chunk's logit
gradient is ``(softmax − one-hot) / divisor``, scaled in float32 before its rounding, so the backward of the usual
``loss.backward()`` receives exactly ``1 / divisor`` and has nothing left to scale. It still scales by whatever it
receives over that (a loss multiplied by 2, say), so the gradients are right for any incoming gradient; only the
unit case is free: no pass over the ``[V, D]`` float32 weight gradient where the weight's owner skips a factor of
one on the device.

Where the weight's owner already holds a float32 gradient (FSDP2 between micro-batches that do not reduce) and the
micro-batch is one chunk, the chunk's logit gradient is kept for backward instead of its ``[V, D]`` product, and
backward adds the product into the held gradient in the GEMM's epilogue: no fresh float32 ``[V, D]`` buffer and no
pass adding it in (micro-batch 1 of 4,096 tokens; the kept ``[C, V]`` bf16 is the size of the float32 ``[V, D]`` at
``C = 2D``).

The per-chunk loss and logit gradient is :func:`ce_chunk`, passed in as ``chunk_loss`` so that a compiled version
can replace it (``parallelize`` does that on the model's head) without a global switch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

IGNORE_INDEX = -100
"""Label value that the loss ignores (padding, prompts), as in transformers and ``torch.nn.CrossEntropyLoss``."""
LOSS_CHUNK_TOKENS = 4096
"""Tokens per chunk of :func:`linear_cross_entropy` by default (the LM head's): while a chunk's loss is computed its
logits and their gradient are alive, ``2 x chunk x V`` elements in the compute dtype."""


def ce_chunk(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, grad_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk and its gradient w.r.t. the logits (in the logits' dtype).

    Statistics in float32; ``-100`` targets contribute nothing. ``grad_scale`` (a one-element float32 tensor, read
    on the device): the gradient is multiplied by it in float32, before it is rounded to the logits' dtype.
    """
    x_CV = logits_CV.float()
    lse_C = torch.logsumexp(x_CV, dim=-1)
    valid_C = targets_C != IGNORE_INDEX
    safe_C = torch.where(valid_C, targets_C, torch.zeros_like(targets_C))
    picked_C = x_CV.gather(1, safe_C[:, None]).squeeze(1)
    loss = torch.where(valid_C, lse_C - picked_C, torch.zeros_like(lse_C)).sum()
    # d(sum of losses)/d logits = softmax - one_hot(target), zero on ignored rows.
    one_hot_CV = torch.arange(x_CV.shape[1], device=x_CV.device)[None, :] == safe_C[:, None]
    grad_CV = (torch.exp(x_CV - lse_C[:, None]) - one_hot_CV.float()) * valid_C[:, None].float()
    if grad_scale is not None:
        grad_CV = grad_CV * grad_scale.float()
    return loss, grad_CV.to(logits_CV.dtype)


ChunkLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]
"""``(logits_CV, targets_C, grad_scale) -> (summed loss, d loss / d logits_CV times grad_scale)``, as
:func:`ce_chunk`; ``grad_scale`` is None or a one-element float32 tensor. The logits are a temporary of the call
(:func:`linear_cross_entropy` computes each chunk's for it alone), so a chunk loss may write the gradient over them
and return that storage (``ce_chunk_triton_``, the triton tier's on CUDA): one ``[C, V]`` buffer per chunk, not
two."""

_FOLDS_SCALE = (torch.bfloat16, torch.float32)
"""Logit dtypes whose gradient takes the loss's divisor before rounding: float32's exponent range, so a softmax
of 1e-7 over 1e5 tokens still has a value. float16 (its smallest value 6e-8) would flush such entries to zero:
there the gradient is scaled after the GEMMs, as before."""


def _accumulate_mm(acc_fp32: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc = a @ b`` (``first``) or ``acc += a @ b``, in float32. On CUDA with 16-bit inputs the product is written
    in float32 by the GEMM's epilogue (``mm``/``addmm`` with ``out_dtype=float32``), the addition too: no pass over
    the ``[V, D]`` accumulator besides the GEMM's, and none to zero it first."""
    if acc_fp32.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if first:
            torch.mm(a, b, out_dtype=torch.float32, out=acc_fp32)
        else:
            torch.addmm(acc_fp32, a, b, out_dtype=torch.float32, out=acc_fp32)
    elif first:
        acc_fp32.copy_(a @ b)
    else:
        acc_fp32 += (a @ b).float()


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: D102
        ctx,
        h_ND: torch.Tensor,
        w_VD: torch.Tensor,
        targets_N: torch.Tensor,
        chunk: int,
        chunk_loss: ChunkLoss,
        grad_target: Callable[[torch.Tensor], Any] | None,
        grad_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        N = h_ND.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Where the weight's owner takes its gradient in float32 (FSDP2's reduce dtype), the float32 sum is kept for
        # backward and handed over there, scaled; otherwise it is rounded to the weight's dtype here.
        target = grad_target(w_VD) if need_w and grad_target is not None else None
        if target is not None and target.dtype != torch.float32:
            target = None
        # One chunk whose owner holds a float32 gradient already (a later micro-batch that does not reduce): its
        # logit gradient is kept instead, and backward adds its product into the held gradient in the GEMM itself.
        # The same bytes held from forward to backward at C = 2D (a [C, V] bf16 against a [V, D] float32), no new
        # float32 [V, D] buffer, and no separate pass to add one into the other.
        defer = (
            target is not None
            and grad_scale is not None
            and 0 < N <= chunk
            and callable(getattr(target, "add_product_", None))
            and target.held() is not None
        )
        grad_h_ND = torch.empty_like(h_ND) if need_h else None
        # Written by the first chunk's GEMM, accumulated by the others' (zeroed here only when there is no chunk).
        grad_w_VD = torch.empty(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w and not defer else None
        if grad_w_VD is not None and N == 0:
            grad_w_VD.zero_()
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        ctx.deferred = None
        for start in range(0, N, chunk):
            h_CD = h_ND[start : start + chunk]
            t_C = targets_N[start : start + chunk]
            loss_C, g_CV = chunk_loss(h_CD @ w_VD.t(), t_C, grad_scale)
            loss += loss_C
            if need_h:
                torch.mm(g_CV, w_VD, out=grad_h_ND[start : start + chunk])
            if defer:
                ctx.deferred = g_CV
            elif need_w:
                _accumulate_mm(grad_w_VD, g_CV.t(), h_CD, first=start == 0)
            # Dropped before the next chunk's logits exist: else the next chunk's logits and gradient are alive
            # beside this chunk's gradient, one [C, V] buffer more than a chunk needs.
            del g_CV
        ctx.target, ctx.grad_w_fp32 = target, grad_w_VD if target is not None else None
        keep_w = None if grad_w_VD is None or target is not None else grad_w_VD.to(w_VD.dtype)
        ctx.save_for_backward(grad_h_ND, keep_w, grad_scale, h_ND if defer else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # noqa: D102
        grad_h_ND, grad_w_VD, grad_scale, h_ND = ctx.saved_tensors
        # The gradients hold grad_scale already: what is left is the incoming gradient over it, exactly 1 where the
        # loss is the sum over the divisor and nothing scales it after (1/d over fl(1/d), both correctly rounded).
        if grad_scale is not None:
            grad_loss = grad_loss / grad_scale
        if ctx.target is not None:
            grad_w_fp32, deferred, ctx.grad_w_fp32, ctx.deferred = ctx.grad_w_fp32, ctx.deferred, None, None
            if grad_w_fp32 is None and deferred is None:
                raise RuntimeError(
                    "backward through the LM head's chunked loss ran twice: its weight gradient was handed to its "
                    "owner the first time (run backward once per forward, or use a head without a gradient target)"
                )
            if deferred is not None:  # held += factor * g^T h, in the GEMM's epilogue (the factor is one: no pass)
                ctx.target.add_product_(deferred, h_ND, scale=grad_loss)
            else:
                ctx.target.add_(grad_w_fp32, scale=grad_loss)  # scaled and added in one pass where one is held
        return *_scaled(grad_h_ND, grad_w_VD, factor=grad_loss), None, None, None, None, None


def _scaled(*grads: torch.Tensor | None, factor: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Each gradient times the one-element ``factor``, read on the device: one ``_foreach_mul`` per dtype.

    The product is taken in float32 with the float32 factor for every dtype: a 16-bit gradient is rounded once,
    after the product, and never scaled by a rounded factor (a factor cast to bf16 is off by up to 2^-8 of itself,
    which is how a bf16 model's gradients once took the loss's divisor). For 16-bit gradients on CUDA
    ``_foreach_mul`` then runs one broadcasting kernel per tensor instead of its vectorised one (about twice the
    vectorised one's time at the ``[V, D]`` head's bf16 gradient; the hidden states' ``[N, D]`` is ~5x smaller).
    With the divisor folded in the factor is one, exact either way."""
    out: list[torch.Tensor | None] = list(grads)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(i)
    factor = factor.float()
    for idx in by_dtype.values():
        for i, g in zip(idx, torch._foreach_mul([grads[i] for i in idx], factor)):
            out[i] = g
    return tuple(out)


def linear_cross_entropy(
    h_ND: torch.Tensor,
    w_VD: torch.Tensor,
    targets_N: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_size: int = LOSS_CHUNK_TOKENS,
    chunk_loss: ChunkLoss = ce_chunk,
    grad_target: Callable[[torch.Tensor], Any] | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``h @ w.T`` against ``targets`` (-100 ignored), chunked; never holds all logits.

    Args:
        h_ND: hidden states (already shifted to align with ``targets_N``).
        w_VD: the LM head weight.
        targets_N: next-token ids, ``-100`` where ignored.
        num_items_in_batch: divide the summed loss by this; None: mean over non-ignored targets.
        chunk_size: tokens per chunk (fp32 logits of one chunk: ``chunk_size × V × 4`` bytes).
        chunk_loss: ``(logits_CV, targets_C, grad_scale) -> (summed loss, d loss / d logits_CV x grad_scale)`` of
            one chunk (:data:`ChunkLoss`); default :func:`ce_chunk` (a compiled version of it fuses its passes over
            the logits). It is given ``1 / divisor`` as ``grad_scale`` where the logits are bfloat16 or float32
            (module docstring), else None.
        grad_target: ``target(w_VD) -> ReducedGrad | None`` (``moeshard.fsdp_moe.reduced_grad_target`` of the head's
            FSDP unit): where it answers a float32 holder, the weight's float32 gradient sum is scaled in backward
            and added there (FSDP2 reduces it as its own float32 gradient) and autograd gets none for ``w_VD``; it
            is never rounded to the weight's dtype. Where the holder holds a gradient already and the tokens are
            one chunk, backward adds the chunk's product into it in one GEMM (``add_product_``) instead. None (or an
            answer of None): the gradient goes to autograd.

    Returns:
        The scalar loss in float32.
    """
    if h_ND.dim() != 2 or targets_N.shape != h_ND.shape[:1]:
        raise ValueError(f"h must be [N, D] and targets [N], got {tuple(h_ND.shape)} and {tuple(targets_N.shape)}")
    targets_N = targets_N.to(h_ND.device)
    if num_items_in_batch is None:
        divisor = (targets_N != IGNORE_INDEX).sum().clamp_min(1)
    elif torch.is_tensor(num_items_in_batch):
        divisor = num_items_in_batch.to(h_ND.device)
    else:
        divisor = num_items_in_batch
    grad_scale = None
    if h_ND.dtype in _FOLDS_SCALE and torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
        grad_scale = _reciprocal(divisor, h_ND.device)
    total = _LinearCrossEntropySum.apply(h_ND, w_VD, targets_N, chunk_size, chunk_loss, grad_target, grad_scale)
    return total / divisor


def _reciprocal(divisor: int | float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``1 / divisor`` as a float32 tensor on ``device``, the value autograd gives ``total`` in the backward of
    ``total / divisor`` (a correctly rounded float32 division either way), without a host-to-device copy."""
    if torch.is_tensor(divisor):
        return torch.reciprocal(divisor.to(torch.float32))
    return torch.full((), 1.0 / float(divisor), dtype=torch.float32, device=device)
