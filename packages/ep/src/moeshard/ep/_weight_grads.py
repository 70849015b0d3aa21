"""The experts' weight gradients handed from the expert pass to their owner: the :data:`WeightGradTarget` contract.

**Weight gradients into a buffer.** A :data:`WeightGradTarget` (``target(weight) -> buffer | None``), given by the
owner of the weights' gradients (``EPInfo.accumulate_weight_grads``), lets backward add the weight gradients into
the gradient that is already there (gradient accumulation's later micro-batches) instead of returning a new tensor
that autograd then adds in a separate pass: with the triton tier on CUDA the add happens inside the grouped GEMM
(``moeshard.ep._wgrad_triton``), elsewhere as one ``add_``. For such a weight backward returns no gradient.

**Weight gradients handed over unformed.** A target that also has a ``take(weight, factors) -> bool`` method is
offered each pass's gradient of a weight as its :class:`WeightGradFactors` (``a[rows_e]^T @ b[rows_e]`` per
expert, before the product) first: where it answers True it took them (kept them to form later with
:func:`sum_weight_grads`, e.g. all micro-batches of a step in one grouped GEMM, or formed them itself) and backward
returns no gradient for that weight; where it answers False backward asks ``target(weight)`` as above. Every
dispatcher offers factors: the local and all-to-all ones one part per weight and backward, the overlapped one three
(its own copies' two halves and the received copies, each with offsets over all local experts: a half's other
experts have no rows); the parts it does not take are summed and added into ``target(weight)`` once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshard.ep._kernels import Kernels, resolve_gemm
from moeshard.ep._squares import check_squares, read_squares

__all__ = [
    "Handoff",
    "WeightGradFactors",
    "WeightGradTarget",
    "add_into",
    "sum_weight_grads",
    "takes_factors",
    "weight_grad_buffers",
]

WeightGradTarget = Callable[[torch.Tensor], "torch.Tensor | None"]
"""``target(weight) -> buffer | None``, asked in backward for each expert weight (the tensor the forward received):
a contiguous tensor of the weight's shape and dtype holding its gradient so far, into which backward adds this
pass's gradient (and then returns none for that weight), or None for a gradient returned to autograd as usual.

A target may also have ``take(weight, factors: WeightGradFactors) -> bool``, asked first where the backward has the
gradient as factors: True means it took them (backward returns none for that weight and asks nothing more). A
backward that computes a weight's gradient in several parts offers each (the overlapped dispatcher: three); the
gradient is the sum of what the target took and what it did not. A target with ``take`` may also have
``wants_factors() -> bool``, asked once per backward before anything is offered: False means that backward offers
none (and prepares nothing for them). A target may also have ``expect_factors(elements: float) -> None``, told by
the dispatcher in each forward what keeping that pass's factors would hold, in elements of the compute dtype
(:meth:`moeshard.ep.ExpertDispatch.kept_factor_elements`: from shapes, before any is made), so the target can
decide up front whether keeping them fits its memory."""


@dataclass(frozen=True)
class WeightGradFactors:
    """One pass's gradient of one expert weight, unformed: ``grad[e] = a[rows_e]^T @ b[rows_e]`` for each local
    expert ``e``, rows grouped by expert (see :data:`WeightGradTarget`'s ``take``).

    Attributes:
        a: ``[N, M]`` (the gradient of the weight's output rows: gate/up's ``[N, 2F]``, down's ``[N, D]``).
        b: ``[N, K]`` (the weight's input rows: gate/up's ``[N, D]``, down's gated activation ``[N, F]``).
        offsets: ``[E]`` int32 cumulative row ends per expert, on the rows' device.
        kernels: the kernel tier of the pass that made them (what :func:`sum_weight_grads` forms them with).
    """

    a: torch.Tensor
    b: torch.Tensor
    offsets: torch.Tensor
    kernels: Kernels

    @property
    def nbytes(self) -> int:
        """Bytes that keeping these factors holds (the storages of ``a`` and ``b``; a view holds its whole base)."""
        return sum(t.untyped_storage().nbytes() for t in (self.a, self.b, self.offsets))


def sum_weight_grads(
    factors: Sequence[WeightGradFactors], out: torch.Tensor | None = None, *, squares: torch.Tensor | None = None
) -> torch.Tensor:
    """Form kept weight gradients: ``out[e] += Σ_p a_p[rows_e]^T @ b_p[rows_e]`` over every factor's rows, or a new
    ``[E, M, K]`` tensor of ``a``'s dtype holding that sum where ``out`` is None. Returns the gradient.

    With the triton tier on CUDA the parts run as one grouped GEMM (``moeshard.ep._wgrad_triton``, up to four parts
    per launch): the gradient is written (or read and written) once, products summed in float32 and rounded once,
    whatever the number of micro-batches; a single part written anew goes to torch's ``grouped_mm``. Elsewhere each
    part's product is added in turn (in ``out``'s dtype).

    ``squares``: a one-element float32 tensor on the factors' device, or None. Given, it receives the formed
    gradient's ``Σ grad²`` (what a clipping norm reads), from the grouped GEMM's epilogue where the triton kernel
    writes the gradient, else by reading it once.
    """
    if not factors:
        raise ValueError("sum_weight_grads needs at least one WeightGradFactors")
    first = factors[0]
    E, M, K = first.offsets.numel(), first.a.shape[1], first.b.shape[1]
    for f in factors:
        if f.offsets.numel() != E or f.a.shape[1] != M or f.b.shape[1] != K or f.a.shape[0] != f.b.shape[0]:
            raise ValueError(
                f"sum_weight_grads: factors of different weights (a {tuple(f.a.shape)}, b {tuple(f.b.shape)}, "
                f"{f.offsets.numel()} experts against a [*, {M}], b [*, {K}], {E} experts)"
            )
    if out is not None and out.shape != (E, M, K):
        raise ValueError(f"sum_weight_grads: out {tuple(out.shape)} is not the gradient's [{E}, {M}, {K}]")
    parts = [(f.a, f.b, f.offsets) for f in factors]
    check_squares("sum_weight_grads", squares)
    if out is None and len(parts) == 1 and first.a.is_cuda and resolve_gemm("auto", first.a, first.b) == "grouped_mm":
        grad = F.grouped_mm(first.a.transpose(0, 1), first.b, offs=first.offsets)
        if squares is not None:
            read_squares(grad, squares)
        return grad
    accumulate = out is not None
    if out is None:
        out = torch.empty((E, M, K), dtype=first.a.dtype, device=first.a.device)
    first.kernels.weight_grad_sum(parts, out, accumulate, squares)
    return out


class Handoff:
    """One weight's gradient destination in a backward whose target can take factors: ``take`` first, then the
    target's buffer (or None: a gradient returned to autograd).

    ``offsets``: the factors' row ends over all of ``weight``'s experts where the pass runs on a part of them (the
    overlapped dispatcher's halves); None: the pass's own. ``buffer=False``: where the target does not take them,
    a new gradient (the caller adds the parts and asks for the buffer itself)."""

    def __init__(
        self, target: WeightGradTarget, weight: torch.Tensor, offsets: torch.Tensor | None = None, buffer: bool = True
    ):
        self.target, self.weight, self.offsets, self.buffer = target, weight, offsets, buffer

    def resolve(self, a_NM, b_NK, offsets, kernels) -> tuple[bool, torch.Tensor | None]:
        """``(taken, buffer)``: whether the target took the factors, else its buffer for this weight (or None)."""
        offsets = offsets if self.offsets is None else self.offsets
        if self.target.take(self.weight, WeightGradFactors(a_NM, b_NK, offsets, kernels)):
            return True, None
        return False, self.target(self.weight) if self.buffer else None


def takes_factors(target: WeightGradTarget | None) -> bool:
    """Whether ``target`` is to be offered this backward's weight gradients as factors: it has a ``take`` method and
    no ``wants_factors`` method answering False."""
    if target is None or not callable(getattr(target, "take", None)):
        return False
    wants = getattr(target, "wants_factors", None)
    return wants is None or bool(wants())


def add_into(grad: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor | None:
    if into is None:
        return grad
    into.add_(grad)
    return None


def weight_grad_buffers(
    target: WeightGradTarget | None, w_gate_up, w_down, need_w1: bool, need_w2: bool, *, factors: bool = False
):
    """``into`` for :meth:`ExpertPass.backward`: the target's buffer for each weight whose gradient is needed, or
    with ``factors`` (a caller that hands factors over) where the target can ``take`` them, a hand-off asked in
    backward once the factors exist."""
    if target is None:
        return None, None
    if factors and takes_factors(target):
        return Handoff(target, w_gate_up) if need_w1 else None, Handoff(target, w_down) if need_w2 else None
    return target(w_gate_up) if need_w1 else None, target(w_down) if need_w2 else None
