"""Low-rank deltas of the fused expert weights (adapters), and their passage through an autograd Function.

# E local experts, r the delta's rank

Each weight of the expert MLP may carry a :class:`LowRankDelta`: per expert ``A_e [r, in]`` and ``B_e [out, r]``
whose product, scaled, is added to that expert's weight, ``W_e + s · B_e A_e``. The pass
(:class:`~moeshard.ep._expert_pass.ExpertPass`) applies it to the grouped rows as two more grouped GEMMs of rank ``r``
beside the base GEMM (``x W_eᵀ + s · (x A_eᵀ) B_eᵀ``), never forming the sum nor a weight per row, and backward gives
``A`` and ``B`` their gradients by grouped GEMMs too. A frozen base weight (``requires_grad`` False) gets no gradient:
its weight-gradient GEMMs are not run, which is what makes adapter training cheaper than training the weights.

Autograd Functions take tensors as inputs, not tuples of them: :func:`delta_inputs` checks a pair of deltas and
flattens it into ``(scalings, A1, B1, A2, B2)``, :func:`_deltas` builds the pair again inside the Function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["NO_DELTAS", "LowRankDelta", "delta_inputs"]


class LowRankDelta(NamedTuple):
    """A low-rank change of one fused expert weight ``W [E, out, in]``: each expert's ``W_e + scaling · B_e A_e``.

    ``A``: ``[E, r, in]``; ``B``: ``[E, out, r]`` (this rank's experts, like the weight; cast to the rows' dtype by
    the dispatcher, so a float32 master gets its gradient through the cast). LoRA's adapters of a fused expert
    tensor are one (``moeshard.lora``).
    """

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    def check(self, weight: torch.Tensor, what: str) -> None:
        """ValueError unless the delta fits ``weight`` ``[E, out, in]``."""
        E, out_f, in_f = weight.shape
        A, B = self.A, self.B
        if (
            A.dim() != 3
            or B.dim() != 3
            or tuple(A.shape[::2]) != (E, in_f)
            or tuple(B.shape[:2]) != (E, out_f)
            or (A.shape[1] != B.shape[2])
        ):
            raise ValueError(
                f"the low-rank delta of {what} {tuple(weight.shape)} must be A [{E}, r, {in_f}] and B [{E}, {out_f}, "
                f"r], got {tuple(A.shape)} and {tuple(B.shape)}"
            )

    def to(self, dtype: torch.dtype) -> LowRankDelta:
        """The same delta with ``A`` and ``B`` in ``dtype`` (a differentiable cast)."""
        return LowRankDelta(self.A.to(dtype), self.B.to(dtype), self.scaling)

    def experts(self, sl: slice) -> LowRankDelta:
        """The delta of the experts ``sl`` only."""
        return LowRankDelta(self.A[sl], self.B[sl], self.scaling)


NO_DELTAS: tuple[None, None] = (None, None)


def _deltas(scalings, A1, B1, A2, B2) -> tuple[LowRankDelta | None, LowRankDelta | None]:
    """The deltas again from their tensors (autograd Functions take tensors as inputs, not tuples of them)."""
    return tuple(
        None if A is None else LowRankDelta(A, B, s) for A, B, s in ((A1, B1, scalings[0]), (A2, B2, scalings[1]))
    )


def delta_inputs(deltas, weights, dtype) -> tuple:
    """``(scalings, A1, B1, A2, B2)``: the autograd inputs of ``deltas`` (per weight, a :class:`LowRankDelta` or
    None), checked against ``weights`` and cast to ``dtype``."""
    if len(deltas) != 2:
        raise ValueError(f"deltas must be a pair (gate/up, down) of LowRankDelta or None, got {len(deltas)} entries")
    tensors, scalings = [], []
    for delta, w, what in zip(deltas, weights, ("w_gate_up", "w_down")):
        if delta is None:
            tensors += [None, None]
            scalings.append(0.0)
            continue
        if not isinstance(delta, LowRankDelta):
            raise ValueError(
                f"the delta of {what} must be a moeshard.ep.LowRankDelta or None, got {type(delta).__name__}"
            )
        delta.check(w, what)
        delta = delta.to(dtype)
        tensors += [delta.A.contiguous(), delta.B.contiguous()]
        scalings.append(float(delta.scaling))
    return (tuple(scalings), *tensors)
