"""Expert modules without FSDP where ``ep_fsdp`` has one rank: DTensor parameters, local tensors in the forward.

On a one-rank ``ep_fsdp`` mesh nothing is gathered or reduced, yet an FSDP2 unit still costs, per expert module
and step, a cast into an all-gather buffer and a copy out of it in forward, and in backward a copy of the gradients
into a reduce-scatter buffer, a division into a temporary and a copy into the sharded gradient, plus its hooks'
CPU time. Here the parameters stay exactly what FSDP2 would have made of them — DTensors ``Shard(1)`` on the
``ep_fsdp`` mesh in the master dtype — so state dicts, DCP resharding, clipping, the optimizer and the metadata see
no difference, and two hooks on the expert module do the rest:

- forward pre-hook: each parameter in ``module._parameters`` is replaced by :class:`_ToCompute` of it (its local
  tensor, cast to ``mp_policy.param_dtype`` where the parameter holds the master), the way FSDP2 swaps in its
  unsharded parameters; floating-point inputs are cast like FSDP2's ``cast_forward_inputs``;
- forward hook (also on an exception, e.g. the early stop of a checkpoint's recomputation): the parameters go
  back; outputs are cast to ``mp_policy.output_dtype`` if set.

Two modes per parameter:

- *master* (``shard_model``'s result; what torch's AdamW steps): the parameter is the float32 master;
  :class:`_ToCompute`'s backward is the whole gradient path: the compute-dtype gradient times the divide factor
  ``1 / W`` (W the world size, as FSDP2 applies it), in the master dtype, in one pass, returned as a DTensor like
  the parameter, so autograd stores it in (first micro-batch) or adds it to (later ones) ``param.grad``. With
  activation checkpointing the recomputation casts again; only the first forward's graph carries the gradients.
- *compute* (after :class:`LocalExpertAdamW` took the master into its state): the parameter is
  already in the compute dtype; the forward uses its local tensor as it is and the backward hands the gradient
  to autograd unchanged (no cast, no divide factor: the optimizer applies ``1 / W`` in float32 as it reads it).

Gradient accumulation in *compute* mode: :meth:`LocalExperts.grad_buffer` is the ``moeshard.ep.WeightGradTarget``
that ``shard_model`` hands to the module's EP dispatcher (``EPInfo.accumulate_weight_grads``). Once a parameter has
a gradient (the first micro-batch's, stored by autograd), the dispatcher's backward adds the next micro-batches'
gradients straight into it (inside the grouped GEMM on CUDA with the triton tier) instead of returning a new tensor
for autograd to add in a second pass; :class:`_ToCompute` then gets no gradient and passes none on.

Weight gradients kept unformed (*compute* mode): under :class:`LocalExpertAdamW` with
``ExpertGradOptions(micro_batches=n)`` every step defers by itself (each ``zero_grad`` starts one; the first ``n - 1``
backwards of each weight defer, the ``n``-th forms; ``auto`` decides per step from what the EP dispatcher reports
its factors would hold, ``_deferral``); :func:`defer_expert_weight_grads` sets the same by hand until the next
``zero_grad``. While deferring, the
dispatcher's backward hands each micro-batch's gradient of a weight over as its factors (``moeshard.ep``'s
``WeightGradFactors``: the rows of the weight's input and of its output's gradient, grouped by expert), and the
module keeps them instead of forming the gradient, as long as what it holds for its gradients (the kept factors, each
storage once, and any gradient already formed) stays within ``budget`` times the gradients' bytes. The first backward
after deferring stops (the step's last micro-batch) takes every part it offers too and, once a weight's backward is
over (its :class:`_ToCompute`'s backward), forms everything kept for it in one grouped GEMM; the first factor the
budget does not admit forms everything the module keeps at once
(``moeshard.ep.sum_weight_grads``): each expert's gradient is written once over all the micro-batches' rows instead
of being written at the first and read and written again at every later one. Kept factors are part of the
parameter's gradient: :class:`LocalExpertAdamW` refuses to read gradients while any are kept and
its ``zero_grad`` drops them with the gradients.

Forming a gradient also records its sum of squares for the clipping norm (``_grad_records.formed_squares``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from moeshard.fsdp_moe._deferral import DEFAULT_BUDGET, ExpertGradOptions, expert_grad_budget, kept_factor_ratio
from moeshard.fsdp_moe._grad_records import (
    drop_kept_factors,
    forget_squares,
    keep_factors,
    kept_factors,
    record_squares,
)
from moeshard.fsdp_moe._torch_internals import local_tensor, tree_map_only

__all__ = [
    "defer_expert_weight_grads",
    "dtensor_like",
    "keep_experts_local",
    "local_experts_state",
]

_STATE_ATTR = "_moeshard_local_experts"
_UNDECIDED = object()  # a step's budget before its first backward asks for it


class _ToCompute(torch.autograd.Function):
    """DTensor parameter → its local tensor (cast to ``dtype`` unless None); gradient → ``grad * scale`` as a
    contiguous DTensor of the parameter's dtype (computed by ``scale_fn``: :func:`scaled` or its compiled form).
    ``done``: called first in backward, once the module's backward for this parameter is over (None: nothing)."""

    @staticmethod
    def forward(
        ctx: Any,
        param: DTensor,
        dtype: torch.dtype | None,
        scale: float,
        scale_fn: Callable | None = None,
        done: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        ctx.spec = (param.device_mesh, param.placements, param.shape, param.stride(), param.dtype)
        ctx.scale = scale
        ctx.scale_fn = scale_fn or scaled
        ctx.done = done
        ctx.set_materialize_grads(False)  # none comes where the gradient was added into param.grad already
        local = param.to_local()  # the local tensor itself (no autograd inside forward)
        if dtype is None or dtype == local.dtype:
            return local.view_as(local)  # a fresh tensor object: autograd writes its metadata into it
        return local.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[DTensor | None, None, None, None, None]:
        if ctx.done is not None:
            ctx.done()
        if grad is None:  # added into param.grad, or kept, by the weight-gradient target (LocalExperts)
            return None, None, None, None, None
        mesh, placements, shape, stride, dtype = ctx.spec
        if ctx.scale != 1.0 or grad.dtype != dtype or not grad.is_contiguous():
            # One pass into a contiguous tensor of the parameter's dtype (its layout, as the optimizer expects).
            # The factor is a one-element tensor of the master dtype, not a Python scalar: type promotion then
            # computes in the master dtype (float32) in the kernel that reads the compute-dtype gradient, as
            # FSDP2's cast into its float32 buffer followed by its division by W (which CUDA computes as a
            # multiplication by 1/W as well; on CPU the two agree exactly when W is a power of two).
            grad = ctx.scale_fn(grad, ctx.scale, dtype)
        dt = DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)
        return dt, None, None, None, None


def scaled(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` as a new contiguous tensor of ``dtype`` (products computed in ``dtype``), eagerly."""
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    if scale != 1.0:
        torch.mul(grad, torch.full((1,), scale, dtype=dtype, device=grad.device), out=out)
    else:
        out.copy_(grad)
    return out


def _scale_into(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return grad.contiguous().to(dtype) * scale


def compiled_scaled() -> Callable[[torch.Tensor, float, torch.dtype], torch.Tensor]:
    """:func:`scaled` as one compiled, vectorised pass on CUDA (eagerly the broadcast one-element factor keeps the
    kernel from vectorising); the same numbers. Elsewhere :func:`scaled` itself. Compiled on first call; a compile
    that fails raises there (``compile`` was asked for: no silent fallback)."""
    fused = torch.compile(_scale_into, dynamic=False)

    def scale(grad: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
        if grad.is_cuda and factor != 1.0:
            return fused(grad, factor, dtype)
        return scaled(grad, factor, dtype)

    return scale


def _cast_floating(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    # FSDP2's rule for forward inputs and outputs: floating-point tensors only, and only when the dtype differs.
    return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x


class LocalExperts:
    """The hooks' state for one expert module (read with :func:`local_experts_state`).

    Attributes:
        params: the module's parameters by name (the objects the hooks swap in and out).
        mp_policy: the mixed-precision policy the forward follows (FSDP2's).
        scale: the gradient divide factor as a multiplier, ``1 / W``.
        scale_fn: computes ``grad * scale`` into the master dtype in the backward (:func:`scaled`, or
            :func:`compiled_scaled`'s function with ``shard_model(compile=True)``).
        in_compute_dtype: names of the parameters in *compute* mode (their master lives in an optimizer).
        deferring: whether backward keeps weight-gradient factors (see :func:`defer_expert_weight_grads`).
        budget: the most that kept factors and formed gradients may hold, as a multiple of :meth:`grad_bytes`.
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        mp_policy: MixedPrecisionPolicy,
        scale: float,
        scale_fn: Callable[[torch.Tensor, float, torch.dtype], torch.Tensor] = scaled,
    ):
        self.params = params
        self.mp_policy = mp_policy
        self.scale = scale
        self.scale_fn = scale_fn
        self.in_compute_dtype: set[str] = set()
        self.deferring = False  # set by defer_expert_weight_grads (explicit), else decided per step (start_step)
        self.budget = DEFAULT_BUDGET
        self._saved: list[tuple[str, nn.Parameter]] = []
        self.start_step(ExpertGradOptions())
        self._expected: float | None = None  # one pass's factor elements, as the dispatcher reports them

    def start_step(self, options: ExpertGradOptions) -> None:
        """A step of ``options.micro_batches`` backwards begins (the optimizer's ``zero_grad``): the backwards of
        each weight are counted from here; what an earlier :func:`defer_expert_weight_grads` set no longer holds."""
        self.options, self._explicit, self.deferring = options, False, False
        self._backwards: dict[int, int] = {}  # id(param) -> backwards over for it in this step
        self._step_budget: Any = _UNDECIDED

    def expect_factors(self, elements: float) -> None:
        """The target's ``expect_factors`` (``moeshard.ep.WeightGradTarget``): one pass's factors would hold
        ``elements`` (compute dtype), as the dispatcher reports them in forward."""
        self._expected = float(elements)

    def _step_defers(self) -> bool:
        """Whether this step keeps factors at all (decided once per step, at its first backward, by
        ``options``: ``auto`` compares what all but the last micro-batch's factors would hold with the budget)."""
        if self._step_budget is _UNDECIDED:
            n = self.options.micro_batches
            budget = None
            if n > 1:
                grad_elements = sum(local_tensor(p).numel() for p in self._compute_params())
                ratio = None if self._expected is None else kept_factor_ratio(self._expected, n, grad_elements)
                budget = expert_grad_budget(self.options.mode, ratio, self.options.budget)
            self._step_budget = budget
            if budget is not None:
                self.budget = budget
        return self._step_budget is not None

    def _deferring_for(self, param: nn.Parameter) -> bool:
        """Whether the backward now running keeps ``param``'s factors: as set by hand, else every backward of the
        step but its last."""
        if self._explicit:
            return self.deferring
        return self._step_defers() and self._backwards.get(id(param), 0) < self.options.micro_batches - 1

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the forward computes in (None: the parameters' own)."""
        return self.mp_policy.param_dtype

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        assert not self._saved, "the expert module's forward was entered twice without leaving it"
        for name in self.params:
            param = module._parameters[name]
            assert isinstance(param, DTensor), (name, type(param))
            self._saved.append((name, param))
            if name in self.in_compute_dtype:
                done = functools.partial(self._backward_done, param)
                module._parameters[name] = _ToCompute.apply(param, None, 1.0, None, done)
            else:
                module._parameters[name] = _ToCompute.apply(param, self.compute_dtype, self.scale, self.scale_fn)
        if self.mp_policy.cast_forward_inputs and self.compute_dtype is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cast_floating(self.compute_dtype, t), (args, kwargs))
        return args, kwargs

    def _compute_param(self, weight: torch.Tensor) -> nn.Parameter | None:
        """The *compute*-mode parameter whose local tensor the forward handed on as ``weight``, or None."""
        for name in self.in_compute_dtype:
            param = self.params[name]
            local = local_tensor(param)
            if weight.data_ptr() == local.data_ptr() and weight.shape == local.shape:
                return param
        return None

    @staticmethod
    def _buffer(param: nn.Parameter, weight: torch.Tensor) -> torch.Tensor | None:
        grad = param.grad
        if grad is None:
            return None
        buf = grad.to_local() if isinstance(grad, DTensor) else grad
        ok = buf.shape == weight.shape and buf.dtype == weight.dtype and buf.is_contiguous()
        return buf if ok else None

    def grad_buffer(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The ``moeshard.ep.WeightGradTarget`` of this module: for ``weight``, the tensor its forward received from
        a *compute*-mode parameter that already has a gradient (or kept factors, formed into one first), that
        gradient's local tensor (the backward adds into it); None otherwise (the first micro-batch, *master* mode, a
        tensor of no parameter here).

        So once such a parameter has a ``.grad``, every backward through the module adds into it, as
        ``loss.backward()`` does; ``torch.autograd.grad`` over these parameters then gets no gradient for them
        (clear ``.grad`` first, or use master mode)."""
        param = self._compute_param(weight)
        if param is None:
            return None
        if kept_factors(param):
            self._form(param, [])
        forget_squares(param)  # the backward adds into it: the recorded squares no longer hold
        return self._buffer(param, weight)

    __call__ = grad_buffer

    def take(self, weight: torch.Tensor, factors: Any) -> bool:
        """The target's ``take`` (``moeshard.ep.WeightGradTarget``): while deferring, keep ``factors`` (a
        ``moeshard.ep.WeightGradFactors`` of ``weight``'s gradient) if the budget admits them (:meth:`held_bytes`
        with them within ``budget`` times :meth:`grad_bytes`); over budget, form everything the module keeps, these
        with ``weight``'s (so what it holds for its gradients stays within the larger of ``budget`` times their
        bytes and their bytes). Not deferring (the step's last backward), keep them with what is kept for
        ``weight``: every part that backward offers (the overlapped dispatcher offers three) is formed together
        with the earlier micro-batches' once the weight's backward is over. False (not taken): nothing kept for
        ``weight`` and not deferring or over budget, or ``weight`` is not a *compute*-mode parameter here."""
        param = self._compute_param(weight)
        if param is None:
            return False
        deferring = self._deferring_for(param)
        if deferring and self.held_bytes(factors) <= self.budget * self.grad_bytes():
            keep_factors(param, factors)
            return True
        if not deferring:  # the step's last backward: joins what is kept, formed when the weight's is over
            if not kept_factors(param):
                return False
            keep_factors(param, factors)
            return True
        for other in self._compute_params():  # over budget: everything the module keeps is formed
            if other is not param and kept_factors(other):
                self._form(other, [])
        if not kept_factors(param):
            return False
        self._form(param, [factors])
        return True

    def wants_factors(self) -> bool:
        """The target's ``wants_factors`` (``moeshard.ep.WeightGradTarget``): whether a backward is to offer factors
        at all, i.e. while deferring or where factors are kept (the step's last backward joins them)."""
        return any(self._deferring_for(p) for p in self._compute_params()) or bool(self._kept())

    def _backward_done(self, param: nn.Parameter) -> None:
        """The module's backward for ``param`` is over (its :class:`_ToCompute`'s backward): where the trainer no
        longer defers, what is kept for it (the earlier micro-batches' factors and every part of this backward's) is
        formed, in one grouped GEMM."""
        if not self._deferring_for(param) and kept_factors(param):
            self._form(param, [])
        self._backwards[id(param)] = self._backwards.get(id(param), 0) + 1

    def _form(self, param: nn.Parameter, more: list) -> None:
        from moeshard.ep import sum_weight_grads

        factors = kept_factors(param) + more
        drop_kept_factors(param)
        buf = self._buffer(param, local_tensor(param))
        if buf is None and param.grad is not None:  # a gradient in another layout (set from outside): add to it
            param.grad = param.grad + dtensor_like(sum_weight_grads(factors).contiguous(), param)
            return
        squares = torch.empty((), dtype=torch.float32, device=local_tensor(param).device)
        if buf is not None:
            sum_weight_grads(factors, buf, squares=squares)
        else:
            param.grad = dtensor_like(sum_weight_grads(factors, squares=squares).contiguous(), param)
        record_squares(param, squares)

    def kept_bytes(self) -> int:
        """Bytes held by this module's kept weight-gradient factors (each storage once: factors of one backward may
        be views of one tensor, e.g. the overlapped dispatcher's halves of the routed copies)."""
        return sum(_storages(self._kept()).values())

    def held_bytes(self, more: Any = None) -> int:
        """Bytes this module holds for its *compute*-mode parameters' gradients: the kept factors (with ``more``, a
        ``WeightGradFactors``, where given) and the gradients already formed. While deferring, :meth:`take` keeps
        factors only while this stays within ``budget`` times :meth:`grad_bytes`, so kept factors stand in for the
        gradients instead of adding to them."""
        kept = _storages(self._kept() + ([more] if more is not None else []))
        grads = [p.grad for p in self._compute_params() if p.grad is not None]
        formed = sum(local_tensor(g).nbytes for g in grads)
        return sum(kept.values()) + formed

    def _compute_params(self) -> list[nn.Parameter]:
        return [self.params[name] for name in self.in_compute_dtype]

    def _kept(self) -> list:
        return [f for p in self._compute_params() for f in kept_factors(p)]

    def grad_bytes(self) -> int:
        """Bytes of the gradients of this module's *compute*-mode parameters (what kept factors stand for)."""
        return sum(local_tensor(p).numel() * p.element_size() for p in self._compute_params())

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for name, param in self._saved:
            module._parameters[name] = param
        self._saved.clear()
        if output is None or self.mp_policy.output_dtype is None:
            return output
        return tree_map_only(torch.Tensor, lambda t: _cast_floating(self.mp_policy.output_dtype, t), output)


def defer_expert_weight_grads(model: nn.Module, defer: bool, *, budget: float = DEFAULT_BUDGET) -> int:
    """By hand: whether the backwards from now on keep the local experts' weight gradients as factors
    (``defer=True``) or form them, with everything kept so far, in the backward that follows (``defer=False``); the
    experts' analogue of FSDP2's ``set_requires_gradient_sync``. A trainer need not call it: the optimizer does the
    same by itself at every step (``build_optimizer(expert_grads=ExpertGradOptions(micro_batches=n))``). Called, it
    governs until the optimizer's next ``zero_grad``: True before the first of a step's micro-batches and False
    before the last (one micro-batch: never needed) write the step's gradients each once over all micro-batches'
    rows. Factors still kept when the optimizer reads the gradients are then refused (its ``zero_grad`` drops them).

    Only *compute*-mode parameters (under :class:`LocalExpertAdamW`) keep any (every
    ``moeshard.ep`` dispatcher hands factors over; the overlapped one each weight's in three parts); the rest form
    their gradients as before. ``budget``: per expert module, what is held for the gradients (kept factors, and
    gradients once formed) stays within this times the gradients' bytes; the first backward whose factors would not
    fit forms everything kept (later micro-batches then add into the gradients as usual, keeping only what still
    fits beside them), so where the rows per micro-batch outweigh the experts (few local experts, large
    micro-batches) nothing is kept.

    Returns:
        The number of expert modules of ``model`` that ``shard_model`` kept out of FSDP (0: nothing to defer).

    Raises:
        ValueError: ``budget`` is negative.
    """
    if budget < 0:
        raise ValueError(f"defer_expert_weight_grads: budget must be >= 0, got {budget}")
    n = 0
    for module in model.modules():
        st = local_experts_state(module)
        if st is not None:
            st.deferring, st.budget, st._explicit = bool(defer), float(budget), True
            n += 1
    return n


def _storages(factors: list) -> dict[int, int]:
    """``{storage address: bytes}`` of the tensors of ``factors`` (``WeightGradFactors``), each storage once."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for f in factors for t in (f.a, f.b, f.offsets)
    }


def local_experts_state(module: nn.Module) -> LocalExperts | None:
    """The state :func:`keep_experts_local` left on ``module``, or None."""
    return module.__dict__.get(_STATE_ATTR)


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor laid out as ``like`` (mesh, placements, global shape, stride)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def keep_experts_local(
    module: nn.Module,
    mesh: DeviceMesh,
    shard_dim: int,
    mp_policy: MixedPrecisionPolicy,
    divide_factor: float,
    *,
    compile: bool = False,
) -> tuple[nn.Parameter, ...]:
    """Turn ``module``'s parameters into DTensors ``Shard(shard_dim)`` on the one-rank ``mesh`` and hook its forward.

    ``compile``: the backward's cast-and-scale compiled (:func:`compiled_scaled`), else eager (:func:`scaled`).

    The parameters are wrapped without a copy (made contiguous, and moved to the mesh's device unless on meta, as
    ``fully_shard`` would); the Parameter objects are new, so build the optimizer afterwards.

    Returns:
        The new parameters (to keep out of the enclosing ``fully_shard`` calls).
    """
    assert mesh.size() == 1, mesh
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())
    params: dict[str, nn.Parameter] = {}
    for name, param in list(module.named_parameters(recurse=False)):
        assert not isinstance(param, DTensor), name
        with torch.no_grad():
            local = param.detach()
            if local.device.type != "meta" and local.device != device:
                local = local.to(device)
            local = local.contiguous()
            dt = DTensor.from_local(
                local, mesh, [Shard(shard_dim)], run_check=False, shape=local.shape, stride=local.stride()
            )
        new = nn.Parameter(dt, requires_grad=param.requires_grad)
        module.register_parameter(name, new)
        params[name] = new
    state = LocalExperts(params, mp_policy, 1 / divide_factor, compiled_scaled() if compile else scaled)
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward, with_kwargs=True, always_call=True)
    setattr(module, _STATE_ATTR, state)
    return tuple(params.values())
