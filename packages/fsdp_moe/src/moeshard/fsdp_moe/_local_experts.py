"""Expert modules without FSDP where ``ep_fsdp`` has one rank: float32 master DTensors, a compute copy per forward.

On a one-rank ``ep_fsdp`` mesh nothing is gathered or reduced, yet an FSDP2 unit still costs, per expert module
and step, a cast into an all-gather buffer and a copy out of it in forward, and in backward a copy of the gradients
into a reduce-scatter buffer, a division into a temporary and a copy into the sharded gradient, plus its hooks'
CPU time. Here the parameters stay exactly what FSDP2 would have made of them — DTensors ``Shard(1)`` on the
``ep_fsdp`` mesh in the master dtype — so state dicts, DCP resharding, clipping, the optimizer and the metadata see
no difference, and two hooks on the expert module do the rest:

- forward pre-hook: each parameter in ``module._parameters`` is replaced by :class:`_ToCompute` of it (its local
  tensor in ``mp_policy.param_dtype``), the way FSDP2 swaps in its unsharded parameters; floating-point inputs are
  cast like FSDP2's ``cast_forward_inputs``;
- forward hook (also on an exception, e.g. the early stop of a checkpoint's recomputation): the parameters go
  back; outputs are cast to ``mp_policy.output_dtype`` if set.

:class:`_ToCompute`'s backward is the whole gradient path: the compute-dtype gradient times the divide factor
``1 / W`` (W the world size, as FSDP2 applies it), in the master dtype, in one pass, returned as a DTensor like the
parameter, so autograd stores it in (first micro-batch) or adds it to (later ones) ``param.grad``. With activation
checkpointing the recomputation casts again; only the first forward's graph carries the gradients.

Fed to the optimizer (:func:`moeshard.fsdp_moe.fuse_local_expert_updates` switches a module into this mode): the
gradient is not cast into ``param.grad`` but kept as it arrives, in the compute dtype, as the parameter's
*pending gradient* (:func:`expert_grad` shows it as the float32 DTensor ``param.grad`` would have been), and the
compute-dtype copy of each parameter is kept between steps: the optimizer's fused update reads the pending
gradient and writes the master weights, the moments and the next forward's copy in one pass. A copy is used only
while the master is unchanged since it was written (the version counters of the DTensor and of its local tensor),
so loading a checkpoint or any other in-place change makes the next forward cast afresh.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

__all__ = ["expert_grad", "keep_experts_local", "local_experts_state", "pending_grads", "pending_to_grad"]

_STATE_ATTR = "_moeshard_local_experts"


class _ToCompute(torch.autograd.Function):
    """DTensor parameter → its local tensor in the compute dtype; gradient → ``grad * scale`` as a DTensor.

    Fed to the optimizer, the gradient goes to the module's pending gradients instead (and None to autograd).
    """

    @staticmethod
    def forward(
        ctx: Any, param: DTensor, dtype: torch.dtype | None, scale: float, state: _LocalExperts, name: str
    ) -> torch.Tensor:
        ctx.spec = (param.device_mesh, param.placements, param.shape, param.stride(), param.dtype)
        ctx.scale = scale
        ctx.fed = (state, name) if state.fed else None
        local = param._local_tensor  # the local tensor itself (no autograd inside forward)
        if dtype is None or dtype == local.dtype:
            return local.view_as(local)  # a fresh tensor object: autograd writes its metadata into it
        if state.fed:
            return state.compute_copy(name, param, dtype).view_as(local)
        return local.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor | None, None, None, None, None]:
        mesh, placements, shape, stride, dtype = ctx.spec
        if ctx.fed is not None:
            state, name = ctx.fed
            state.add_pending(name, grad, ctx.scale, dtype)
            return None, None, None, None, None
        if ctx.scale != 1.0 or grad.dtype != dtype or not grad.is_contiguous():
            # One pass into a contiguous master-dtype tensor (the parameter's layout, as the optimizer expects).
            # The factor is a one-element tensor of the master dtype, not a Python scalar: type promotion then
            # computes in the master dtype (float32) in the kernel that reads the compute-dtype gradient, as
            # FSDP2's cast into its float32 buffer followed by its division by W (which CUDA computes as a
            # multiplication by 1/W as well; on CPU the two agree exactly when W is a power of two).
            grad = _scaled(grad, ctx.scale, dtype)
        return (
            DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride),
            None,
            None,
            None,
            None,
        )


def _scaled(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` as a new contiguous tensor of ``dtype`` (products computed in ``dtype``)."""
    fused = _fused_scale(grad, scale, dtype) if grad.is_cuda and scale != 1.0 else None
    if fused is not None:
        return fused
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    if scale != 1.0:
        torch.mul(grad, torch.full((1,), scale, dtype=dtype, device=grad.device), out=out)
    else:
        out.copy_(grad)
    return out


class PendingGrad:
    """A parameter's gradient as its fused update will read it: ``local * scale * mult`` (see :func:`expert_grad`).

    ``local`` is the compute-dtype gradient of one micro-batch (``scale`` the FSDP divide factor ``1/W``), or from
    the second micro-batch on the float32 sum of the scaled ones (``scale`` 1.0); ``mult`` a float32 scalar tensor
    that in-place clipping multiplies in (None: 1).
    """

    __slots__ = ("local", "mult", "scale")

    def __init__(self, local: torch.Tensor, scale: float):
        self.local = local
        self.scale = scale
        self.mult: torch.Tensor | None = None

    def materialize(self, dtype: torch.dtype) -> torch.Tensor:
        """The gradient as a new tensor of ``dtype`` (the master dtype), computed as the unfused path computes it."""
        out = _scaled(self.local, self.scale, dtype) if self.scale != 1.0 else self.local.to(dtype, copy=True)
        if self.mult is not None:
            out.mul_(self.mult.to(out.device))
        return out


def _scale_into(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return grad.contiguous().to(dtype) * scale


# On CUDA the broadcast one-element factor above keeps the eager kernel from vectorising (~2 TB/s on an H200 for
# 0.6 ms per layer's gate/up gradient); compiled, the same cast-and-multiply is one vectorised pass. Compiled once
# on first use; if compiling is not possible here, the eager kernel stays.
_FUSED: list = [None]


def _fused_scale(grad: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor | None:
    if _FUSED[0] is None:
        try:
            _FUSED[0] = torch.compile(_scale_into, dynamic=False)
        except Exception:  # noqa: BLE001 - no compiler: keep the eager path
            _FUSED[0] = False
    if _FUSED[0] is False:
        return None
    try:
        return _FUSED[0](grad, scale, dtype)
    except Exception:  # noqa: BLE001 - a backend that cannot compile this: eager from now on
        _FUSED[0] = False
        return None


def _versions(param: DTensor) -> tuple[int, int]:
    # In-place changes through the DTensor (an optimizer, a checkpoint load) count on the DTensor's version
    # counter, not its local tensor's (DTensor runs the op below autograd); changes to the local tensor count there.
    return param._version, param._local_tensor._version


def _cast_floating(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    # FSDP2's rule for forward inputs and outputs: floating-point tensors only, and only when the dtype differs.
    return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x


class _LocalExperts:
    """The hooks' state for one expert module (readable with :func:`local_experts_state`)."""

    def __init__(self, names: tuple[str, ...], mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, scale: float):
        self.names = names
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.scale = scale
        self._saved: list[tuple[str, nn.Parameter]] = []
        # Fed to the optimizer (fuse_local_expert_updates): pending gradients, and compute copies kept between
        # steps as {name: (copy, the master local tensor it was made from, the versions then (see _versions))}.
        self.fed = False  # set with feed()
        self.params: dict[str, nn.Parameter] = {}
        self.pending: dict[str, PendingGrad] = {}
        self.copies: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = {}

    def feed(self) -> None:
        """From now on gradients go to ``pending`` and compute copies are kept (see the module docstring)."""
        self.fed = True
        _FED.add(self)

    def compute_copy(self, name: str, param: DTensor, dtype: torch.dtype) -> torch.Tensor:
        """The kept compute-dtype copy of ``name`` if it is still the master's; else a fresh cast, kept."""
        local = param._local_tensor
        kept = self.copies.get(name)
        if kept is not None and kept[1] is local and kept[2] == _versions(param) and kept[0].dtype == dtype:
            return kept[0]
        copy = local.to(dtype)
        self.copies[name] = (copy, local, _versions(param))
        return copy

    def copy_written(self, name: str) -> None:
        """The fused update rewrote ``name``'s master and its copy: the copy matches the master as it is now."""
        kept = self.copies.get(name)
        if kept is not None:
            self.copies[name] = (kept[0], kept[1], _versions(self.params[name]))

    def add_pending(self, name: str, grad: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
        """Keep (first micro-batch) or add (later ones, in ``dtype``) ``name``'s gradient."""
        grad = grad.contiguous()
        pg = self.pending.get(name)
        if pg is None:
            self.pending[name] = PendingGrad(grad, scale)
            return
        if pg.mult is not None:
            raise RuntimeError(
                f"{name}: a gradient arrived after its pending gradient was clipped; clip after the last backward "
                "of the step"
            )
        if pg.scale != 1.0 or pg.local.dtype != dtype:
            # From the second micro-batch on: the float32 sum of the scaled gradients, as param.grad would be.
            pg.local, pg.scale = pg.materialize(dtype), 1.0
        pg.local.add_(_scaled(grad, scale, dtype) if scale != 1.0 or grad.dtype != dtype else grad)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the forward computes in (None: the parameters' own)."""
        return self.mp_policy.param_dtype

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        assert not self._saved, "the expert module's forward was entered twice without leaving it"
        for name in self.names:
            param = module._parameters[name]
            assert isinstance(param, DTensor), (name, type(param))
            self._saved.append((name, param))
            module._parameters[name] = _ToCompute.apply(param, self.compute_dtype, self.scale, self, name)
        if self.mp_policy.cast_forward_inputs and self.compute_dtype is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _cast_floating(self.compute_dtype, t), (args, kwargs))
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for name, param in self._saved:
            module._parameters[name] = param
        self._saved.clear()
        if output is None or self.mp_policy.output_dtype is None:
            return output
        return tree_map_only(torch.Tensor, lambda t: _cast_floating(self.mp_policy.output_dtype, t), output)


def local_experts_state(module: nn.Module) -> _LocalExperts | None:
    """The state :func:`keep_experts_local` left on ``module``, or None."""
    return module.__dict__.get(_STATE_ATTR)


# Every module state whose gradients are fed to an optimizer, to find a parameter's pending gradient. (Nothing is
# stored on the parameters: ``to_empty`` and other ``_apply`` conversions of DTensor parameters swap the Python
# objects' contents, attributes included, with new tensors; the objects themselves stay the module's.)
_FED: weakref.WeakSet[_LocalExperts] = weakref.WeakSet()


def _pending(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, _LocalExperts, str]]:
    """``(param, its module state, its name)`` for each of ``params`` whose gradient waits for a fused update."""
    if not _FED:
        return []
    owners = {id(p): (p, st, name) for st in list(_FED) for name, p in st.params.items()}
    out = []
    for p in params:
        hit = owners.get(id(p))
        if hit is not None and hit[0] is p and hit[2] in hit[1].pending:
            out.append(hit)
    return out


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor laid out as ``like`` (mesh, placements, global shape, stride)."""
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _as_grad(param: torch.Tensor, pg: PendingGrad) -> DTensor:
    """The pending gradient as the float32 DTensor ``param.grad`` would hold (a new tensor)."""
    return dtensor_like(pg.materialize(param.dtype), param)


def pending_grads(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, PendingGrad]]:
    """``(param, pending gradient)`` for each of ``params`` whose gradient waits for a fused update."""
    return [(p, st.pending[name]) for p, st, name in _pending(params)]


def pending_to_grad(params: list[torch.Tensor]) -> int:
    """Move the pending gradients of ``params`` into their ``param.grad`` (float32 DTensors, as unfused); returns
    how many there were."""
    found = _pending(params)
    for p, st, name in found:
        p.grad = _as_grad(p, st.pending.pop(name))
    return len(found)


def expert_grad(param: torch.Tensor) -> torch.Tensor | None:
    """``param.grad``, or for a local expert parameter fed to a fused update its pending gradient as the float32
    DTensor ``param.grad`` would hold (a new tensor; clipping applied so far included). None without either."""
    if param.grad is not None:
        return param.grad
    found = _pending([param])
    return _as_grad(param, found[0][1].pending[found[0][2]]) if found else None


def keep_experts_local(
    module: nn.Module, mesh: DeviceMesh, shard_dim: int, mp_policy: MixedPrecisionPolicy, divide_factor: float
) -> tuple[nn.Parameter, ...]:
    """Turn ``module``'s parameters into DTensors ``Shard(shard_dim)`` on the one-rank ``mesh`` and hook its forward.

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
    state = _LocalExperts(tuple(params), mesh, mp_policy, 1 / divide_factor)
    state.params = dict(params)
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward, with_kwargs=True, always_call=True)
    setattr(module, _STATE_ATTR, state)
    return tuple(params.values())
