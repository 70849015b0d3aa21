"""What a local expert parameter's gradient holds besides ``param.grad``, kept on the parameter itself.

- **Kept factors** (:func:`kept_factors`): the micro-batches' weight-gradient factors (``moeshard.ep``'s
  ``WeightGradFactors``) that ``LocalExperts`` keeps unformed while a trainer defers (see ``_local_experts``).
  They are part of the gradient: ``LocalExpertAdamW`` refuses to read gradients while any are kept, and its
  ``zero_grad`` drops them (:func:`drop_kept_factors`).
- **Formed squares** (:func:`formed_squares`): forming a gradient from kept factors records its ``Σ grad²`` (from the
  grouped GEMM's epilogue on CUDA with the triton tier: no second read of the gradient), which
  ``LocalExpertAdamW.grad_norms`` takes instead of reading the gradient again while it is the same, unchanged
  tensor: the clipping norm's read of the experts' gradients, a tenth of the update's traffic, is gone wherever the
  step formed them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from moeshard.fsdp_moe._torch_internals import local_tensor, tensor_version

__all__ = ["drop_kept_factors", "forget_squares", "formed_squares", "keep_factors", "kept_factors", "record_squares"]

_KEPT_ATTR = "_moeshard_kept_factors"  # its gradient's kept WeightGradFactors (a list)
_SQUARES_ATTR = "_moeshard_formed_squares"  # (its formed gradient's identity and versions, Σ grad²)


def kept_factors(param: torch.Tensor) -> list:
    """The weight-gradient factors kept for ``param`` (a list, empty where none)."""
    return param.__dict__.get(_KEPT_ATTR) or []


def keep_factors(param: torch.Tensor, factors: Any) -> None:
    """Keep ``factors`` (a ``WeightGradFactors``) with those kept for ``param``."""
    param.__dict__.setdefault(_KEPT_ATTR, []).append(factors)


def drop_kept_factors(param: torch.Tensor) -> None:
    """Forget what is kept for ``param``'s gradient besides ``param.grad`` (as ``zero_grad`` forgets the gradient):
    its kept factors and its formed squares."""
    param.__dict__.pop(_KEPT_ATTR, None)
    forget_squares(param)


def record_squares(param: torch.Tensor, squares: torch.Tensor) -> None:
    """Record ``squares`` (a float32 scalar: ``Σ grad²`` of ``param``'s local gradient as just formed) for the
    gradient ``param.grad`` holds now."""
    grad = param.grad
    local = local_tensor(grad)
    # An in-place operation through the DTensor moves the DTensor's counter, one on its local tensor the local's.
    param.__dict__[_SQUARES_ATTR] = (
        weakref.ref(grad),
        tensor_version(grad),
        weakref.ref(local),
        tensor_version(local),
        squares,
    )


def forget_squares(param: torch.Tensor) -> None:
    """Forget the squares recorded for ``param`` (its gradient is about to change, e.g. a backward adds into it)."""
    param.__dict__.pop(_SQUARES_ATTR, None)


def formed_squares(param: torch.Tensor) -> torch.Tensor | None:
    """``Σ grad²`` of ``param``'s local gradient (a float32 scalar on its device), as recorded when it was formed from
    kept factors, if ``param.grad`` is still that tensor and unchanged since (no in-place operation, no backward
    handed it out to add into); else None (read the gradient).

    "Unchanged" is read from version counters. torch's foreach in-place operations on DTensors (e.g.
    ``torch._foreach_mul_`` over DTensor gradients, as ``torch.nn.utils.clip_grad_norm_`` does) move none (torch
    2.13): code that changes these gradients that way calls :func:`forget_squares` on them after (this package's
    clipping multiplies the local tensors, which is seen)."""
    entry = param.__dict__.get(_SQUARES_ATTR)
    if entry is None:
        return None
    grad_ref, grad_version, local_ref, local_version, squares = entry
    grad = param.grad
    if grad is None:
        forget_squares(param)
        return None
    local = local_tensor(grad)
    same = grad_ref() is grad and local_ref() is local
    if not (same and tensor_version(grad) == grad_version and tensor_version(local) == local_version):
        forget_squares(param)
        return None
    return squares
