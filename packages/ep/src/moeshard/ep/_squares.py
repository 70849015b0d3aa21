"""The ``squares`` argument of the weight-gradient kernels (``Σ g²`` of a gradient, read while it is written), shared
by the eager kernels (:mod:`moeshard.ep._kernels`), the triton ones (:mod:`moeshard.ep._wgrad_triton`) and
:mod:`moeshard.ep._weight_grads`."""

from __future__ import annotations

import torch

from moeshard.ep._torch_internals import foreach_norm

__all__ = ["check_squares", "read_squares"]


def check_squares(name: str, squares: torch.Tensor | None) -> None:
    """Refuse a ``squares`` argument that is not a one-element float32 tensor (or None)."""
    if squares is not None and (squares.numel() != 1 or squares.dtype != torch.float32):
        raise ValueError(f"{name}: squares must be a one-element float32 tensor, got {squares.dtype} {squares.shape}")


def read_squares(t: torch.Tensor, squares: torch.Tensor) -> None:
    """``squares = Σ t²`` in float32, by reading ``t`` once (no float32 copy of it)."""
    squares.copy_(foreach_norm([t], 2.0, dtype=torch.float32)[0].square().reshape(squares.shape))
