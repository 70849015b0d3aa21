"""Gradients handed to FSDP2 in its reduce dtype by the module that computes them: :func:`reduced_grad_target`;
the gradients FSDP2 accumulates in its reduce dtype added in one vectorised pass per unit:
:func:`grouped_grad_accumulation`.

With FSDP2's mixed precision (compute in bfloat16, ``reduce_dtype=float32``) autograd writes each backward's
gradient of an unsharded parameter in bfloat16. FSDP2 then casts it to float32, or, between micro-batches that do
not reduce (``set_requires_gradient_sync(False)``), adds it into the float32 gradient it holds for the parameter
(one unvectorised mixed-dtype pass per parameter and micro-batch), and reduce-scatters the float32 sum. A module
that can produce its weight's gradient in float32 itself hands it over here instead, as FSDP2's own held gradient:

- an LM head that accumulates its weight gradient in float32 inside its GEMMs gives that tensor, scaled, rather
  than a bfloat16 copy of it;
- an embedding adds its few rows into the held gradient, where autograd would write a dense ``[V, D]`` bfloat16
  gradient for FSDP2 to add.

FSDP2 reduces the held gradient exactly as one it accumulated itself: the same reduce-scatter, divide factor and
``.grad``, with one rounding less (the bfloat16 one) and two passes over ``[V, D]`` less per micro-batch.

The held gradient is FSDP2's ``FSDPParam.unsharded_accumulated_grad``, a private attribute (torch 2.11-2.13 read
it in the same way: held until the next reducing backward, then reduce-scattered and cleared). Everything here is
inert where FSDP2 would not hold one: no reduce dtype, a reduce dtype equal to the compute dtype (float32 on CPU by
default), a DTensor (tensor-parallel) unsharded parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["ReducedGrad", "ReducedGradTarget", "grouped_grad_accumulation", "reduced_grad_target"]


class ReducedGrad:
    """The gradient FSDP2 holds, in its reduce dtype, for one unsharded parameter until it reduces it.

    Attributes:
        dtype: the reduce dtype (float32).
        shape: the unsharded parameter's shape.
    """

    def __init__(self, fsdp_param: Any) -> None:
        self._param = fsdp_param
        self.dtype: torch.dtype = fsdp_param.reduce_dtype
        self.shape = fsdp_param._unsharded_param.shape

    def held(self) -> torch.Tensor | None:
        """The gradient held so far (this step's earlier backwards since the last reduce), or None."""
        return self._param.unsharded_accumulated_grad

    def add_(self, grad: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Add ``grad`` (the reduce dtype and the parameter's shape), times the one-element tensor ``scale`` if
        given, to the held gradient; where none is held, ``grad`` (scaled in place) becomes it, without a copy (the
        caller gives it up). A scaled add into a held CUDA gradient is one pass (``_grad_triton.scaled_add_``: read
        both, write one); eager torch would take two (the vectorised ``_foreach_mul_``, then the add). Scaling a CUDA
        gradient in place costs no pass where ``scale`` is one (``_grad_triton.scale_``: a gradient that holds its
        scale already, as the LM head's does)."""
        self._check(grad)
        held = self.held()
        if scale is not None and held is not None and held.is_cuda and _triton_importable():
            from moeshard.fsdp_moe import _grad_triton

            _grad_triton.scaled_add_(held, grad, scale.to(held.dtype))
            return
        if scale is not None:
            _scale_in_place(grad, scale)
        if held is None:
            self._param.unsharded_accumulated_grad = grad
        else:
            held.add_(grad)

    def add_product_(self, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Add ``a^T @ b`` (``a`` ``[C, M]``, ``b`` ``[C, N]``, one dtype; ``[M, N]`` the parameter's shape), times
        the one-element tensor ``scale`` if given, to the held gradient, in the reduce dtype; where none is held the
        product becomes it. On CUDA with 16-bit factors the float32 product is added by the GEMM's epilogue
        (``addmm`` with ``out_dtype=float32``): no product tensor and no separate pass (the LM head's later
        micro-batches). ``scale`` is applied to ``a``, in place (the caller gives it up; the product in float32 with
        the float32 factor, rounded once), and on CUDA not at all where it is one (``_grad_triton.scale_``)."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or (a.shape[1], b.shape[1]) != tuple(self.shape):
            raise ValueError(
                f"add_product_ needs a [C, M] and b [C, N] with [M, N] = {tuple(self.shape)} (the unsharded "
                f"parameter's shape), got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        if scale is not None:
            _scale_in_place(a, scale)
        held = self.held()
        half = a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype
        if held is None:
            if a.is_cuda and half:
                held = torch.empty(self.shape, dtype=self.dtype, device=a.device)
                torch.mm(a.t(), b, out_dtype=self.dtype, out=held)
            else:
                held = (a.t() @ b).to(self.dtype)
            self._param.unsharded_accumulated_grad = held
        elif a.is_cuda and half:
            torch.addmm(held, a.t(), b, out_dtype=self.dtype, out=held)
        else:
            held.add_((a.t() @ b).to(self.dtype))

    def zeros_if_none(self) -> torch.Tensor:
        """The held gradient, a new zero one first where none is held (for callers that add into parts of it)."""
        held = self.held()
        if held is None:
            held = torch.zeros(self.shape, dtype=self.dtype, device=self._param._unsharded_param.device)
            self._param.unsharded_accumulated_grad = held
        return held

    def _check(self, grad: torch.Tensor) -> None:
        if grad.dtype != self.dtype or grad.shape != self.shape or not grad.is_contiguous():
            raise ValueError(
                f"a handed-over gradient must be a contiguous {self.dtype} tensor of shape {tuple(self.shape)} "
                f"(the unsharded parameter's), got {grad.dtype} {tuple(grad.shape)}"
            )


def _scale_in_place(t: torch.Tensor, scale: torch.Tensor) -> None:
    """``t *= scale`` (a one-element tensor), the product in float32 with the float32 factor: a 16-bit ``t`` never
    takes a rounded factor. On CUDA ``_grad_triton.scale_``, which makes no pass where the factor is one."""
    scale = scale.reshape(()).float()
    if t.is_cuda and t.is_contiguous() and _triton_importable():
        from moeshard.fsdp_moe import _grad_triton

        _grad_triton.scale_(t, scale)
    else:
        torch._foreach_mul_([t], scale)


ReducedGradTarget = Callable[[torch.Tensor], "ReducedGrad | None"]
"""``target(weight) -> ReducedGrad | None``, asked with the tensor a module's forward received as its weight (the
unsharded parameter): where to put that weight's gradient in the reduce dtype (the module's backward then returns
no gradient for it), or None for a gradient returned to autograd as usual."""


def _param_groups(module: FSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13: one group per mesh of the unit
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def grouped_grad_accumulation(module: nn.Module, *, interpreted: bool = False) -> int:
    """Every FSDP unit in ``module`` adds its parameters' compute-dtype gradients into the float32 ones FSDP2 holds
    between micro-batches in one vectorised pass per unit; returns the number of units' parameter groups set up.

    Between backwards that do not reduce (``set_requires_gradient_sync(False)``), FSDP2 keeps each parameter's
    gradient in its reduce dtype and, after each later backward, adds autograd's bfloat16 gradient into it
    (``FSDPParam.accumulate_unsharded_grad_if_needed``): one unvectorised mixed-dtype kernel per parameter, well
    below the memory bound (``docs/performance.md``). Here each
    unit's post-backward first adds all of them with one Triton kernel (``_grad_triton.add_into_float32``; the same
    float32 sums) and clears the bfloat16 gradients it added, so FSDP2 finds nothing left to add and goes on as it
    would (its reduce, where this backward reduces, takes the held sums).

    Applies to CUDA tensors (and CPU ones with ``interpreted=True``: the caller runs triton's interpreter,
    ``TRITON_INTERPRET=1`` before triton is first imported, as the tests do), 16-bit gradients and a float32 held
    gradient of the same shape; any other parameter is left to FSDP2 as before. Setting up a unit twice is a no-op.
    """
    count = 0
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in _param_groups(unit):
            if getattr(group.post_backward, "accumulates_first", False):
                continue
            group.post_backward = _accumulating_first(group, group.post_backward, interpreted)
            count += 1
    return count


def _accumulating_first(group: Any, post_backward: Callable, interpreted: bool) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        _accumulate(group.fsdp_params, interpreted)
        return post_backward(*args, **kwargs)

    call.accumulates_first = True  # type: ignore[attr-defined]
    return call


def _accumulate(fsdp_params: list[Any], interpreted: bool) -> None:
    dsts, srcs, params = [], [], []
    for fsdp_param in fsdp_params:
        held = getattr(fsdp_param, "unsharded_accumulated_grad", None)
        param = getattr(fsdp_param, "_unsharded_param", None)
        grad = None if param is None else param.grad
        if held is None or grad is None or not (held.is_cuda or (interpreted and held.device.type == "cpu")):
            continue
        if held.dtype != torch.float32 or grad.dtype not in (torch.bfloat16, torch.float16):
            continue
        if type(grad) is not torch.Tensor or grad.shape != held.shape or grad.device != held.device:
            continue  # a DTensor gradient, or one FSDP2 would refuse: left to it
        if not (held.is_contiguous() and grad.is_contiguous()):
            continue
        dsts.append(held)
        srcs.append(grad)
        params.append(param)
    if not dsts or not _triton_importable():
        return
    from moeshard.fsdp_moe import _grad_triton

    _grad_triton.add_into_float32(dsts, srcs)
    for param in params:
        param.grad = None


@functools.cache
def _triton_importable() -> bool:
    try:
        from moeshard.fsdp_moe import _grad_triton  # noqa: F401
    except ImportError:
        return False
    return True


def reduced_grad_target(module: nn.Module) -> ReducedGradTarget:
    """The :data:`ReducedGradTarget` of ``module``'s own FSDP2 parameters (``module`` is an ``FSDPModule``).

    Answers None for a weight that is not one of the unit's unsharded parameters, or where FSDP2 would not hold a
    gradient of another dtype (module docstring). A module holding one sets it as an attribute and asks it in each
    forward (the answer depends on the weight it receives, so models without FSDP are unchanged).

    Raises:
        TypeError: ``module`` is not an FSDP unit (``fully_shard`` it first).
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDP unit: fully_shard it before asking for its target")

    def target(weight: torch.Tensor) -> ReducedGrad | None:
        for group in _param_groups(module):
            for fsdp_param in group.fsdp_params:
                if getattr(fsdp_param, "_unsharded_param", None) is not weight:
                    continue
                reduce_dtype = fsdp_param.reduce_dtype
                if reduce_dtype is None or reduce_dtype == weight.dtype or fsdp_param.is_dtensor:
                    return None
                return ReducedGrad(fsdp_param)
        return None

    return target
