"""Gradient-norm clipping over parameters that live on the two meshes (and plain replicated ones).

Every rank holds disjoint pieces of the gradients:
- a non-expert gradient is a ``Shard(0)`` DTensor over the global ``fsdp`` mesh (all W ranks);
- an expert gradient is a ``Shard(1)`` DTensor over one ``ep_fsdp`` group, and the ep ranks outside that group
  hold *other* experts (EP on dim 0), so its pieces are spread over ep_fsdp x ep = all W ranks as well.
So the global ``sum |g|^p`` is the sum over the world of each rank's local sums: one all-reduce, no
``full_tensor()``, nothing counted twice. Plain (non-DTensor) gradients are copies on every rank and are added
once, after the all-reduce.

With ``optimizer=`` a fused torch Adam/AdamW, ``clip_grad_norm_`` leaves the gradients as they are and hands
``1 / clip_coef`` to the optimizer as its ``grad_scale`` (the attribute ``torch.amp.GradScaler`` uses): the fused
kernel divides each gradient by it as it reads it (and stores the result back), so the separate multiply kernel
and its read of every gradient are saved; the write remains, inside the optimizer's kernel.
The hand-over lives for one ``optimizer.step()``: a step post-hook removes it, and a step pre-hook refuses to
apply it to gradients other than the ones it was computed for.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from moeshard.fsdp_moe._local_experts import PendingGrad, pending_grads
from moeshard.meshes import MeshAxis

__all__ = ["clip_grad_norm_", "get_total_norm"]


def _params(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _split(grads: list[torch.Tensor], world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(pieces summed over the world, replicated tensors counted once) as local tensors."""
    sharded, replicated = [], []
    for g in grads:
        if isinstance(g, PendingGrad):  # a local expert's piece (ep_fsdp mesh of one rank): always owned
            sharded.append(g)
            continue
        if not isinstance(g, DTensor):
            replicated.append(g)
            continue
        mesh, placements = g.device_mesh, g.placements
        if any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"a gradient has a Partial placement {placements}; reduce it before clipping")
        names = mesh.mesh_dim_names or ()
        # A sub-mesh spanning fewer ranks than the world is understood only for the ep_fsdp axis, whose
        # complementary ranks (other ep coordinates) hold other experts, never copies.
        if mesh.size() != world and names != (MeshAxis.EP_FSDP.value,):
            raise ValueError(
                f"a gradient is a DTensor on mesh {names or mesh} of {mesh.size()} ranks in a world of {world}; "
                "only the global fsdp mesh and the ep_fsdp mesh are understood: clip such parameters separately"
            )
        # Along a Replicate mesh dim every coordinate holds the same piece: count it on coordinate 0 only.
        owner = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(placements) if isinstance(p, Replicate))
        if owner:
            sharded.append(g.to_local())
    return sharded, replicated


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local_norms(tensors: list, norm_type: float) -> list[torch.Tensor]:
    """Norms of local tensors and of pending gradients (their factors applied). On CUDA the 2-norm of all pending
    gradients comes as one entry (the triton kernel's): only the sum of the norms' squares is used."""
    by_device: dict[torch.device, list] = {}
    for t in tensors:
        by_device.setdefault(t.local.device if isinstance(t, PendingGrad) else t.device, []).append(t)
    out = []
    for ts in by_device.values():
        fast = _fast_pending_norm(ts, norm_type)
        if fast is not None:
            out.append(fast)
            ts = [t for t in ts if not isinstance(t, PendingGrad)]
            if not ts:
                continue
        # Norms in float32 whatever the gradient dtype, as the reduction of a global norm must be.
        norms = torch._foreach_norm(
            [t.local if isinstance(t, PendingGrad) else t for t in ts], norm_type, dtype=torch.float32
        )
        for t, n in zip(ts, norms, strict=True):
            if isinstance(t, PendingGrad):
                n = n * t.scale if t.scale != 1.0 else n
                n = n * t.mult.to(n.device) if t.mult is not None else n
            out.append(n)
    return out


def _fast_pending_norm(items: list, norm_type: float) -> torch.Tensor | None:
    """The 2-norm of all pending gradients among ``items`` by the triton kernel (CUDA), or None."""
    pend = [t for t in items if isinstance(t, PendingGrad)]
    if norm_type != 2.0 or not pend or not pend[0].local.is_cuda:
        return None
    from moeshard.fsdp_moe._fused_update import _triton_ok

    if not _triton_ok():
        return None
    from moeshard.fsdp_moe._triton import sum_of_squares

    return sum_of_squares([t.local for t in pend], [t.scale**2 for t in pend], [t.mult for t in pend]).sqrt()


def _reduce(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device) for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


@torch.no_grad()
def get_total_norm(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The p-norm of all gradients as if the model lived in one process (every rank gets the same value).

    Args:
        parameters: a sharded model or its parameters (expert, non-expert and plain ones may be mixed).
        norm_type: p of the p-norm, ``float("inf")`` for the max norm.
        group: the process group spanning the world; defaults to the default group.

    Returns:
        A float32 scalar tensor (on the GPU with NCCL, else on the CPU).
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    params = _params(parameters)
    # Local experts' gradients waiting for their fused update (fuse_local_expert_updates) count in their
    # parameter's place: pieces of the ep_fsdp mesh's kind, in the compute dtype, their factors applied to the norm.
    pending = {id(p): pg for p, pg in pending_grads(params)}
    grads = [p.grad if p.grad is not None else pending[id(p)] for p in params if p.grad is not None or id(p) in pending]
    first = (grads[0].local if isinstance(grads[0], PendingGrad) else grads[0]).device if grads else None
    dev = _comm_device(group) if dist.is_initialized() else (first or torch.device("cpu"))
    if not dist.is_initialized():  # one process: nothing to reduce
        return _finish(_reduce(_local_norms(_locals(grads), norm_type), norm_type, dev), norm_type)
    sharded, replicated = _split(grads, dist.get_world_size(group))
    total = _reduce(_local_norms(sharded, norm_type), norm_type, dev)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    rep = _reduce(_local_norms(replicated, norm_type), norm_type, dev)
    total = torch.maximum(total, rep) if math.isinf(norm_type) else total + rep
    return _finish(total, norm_type)


def _locals(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # (PendingGrad passes as it is)


def _finish(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    group: dist.ProcessGroup | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Clip gradients in place by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    The scale is ``min(1, max_norm / (total_norm + 1e-6))``, applied to every rank's local pieces; expert
    gradients (``Shard(1)`` on ep_fsdp) and non-expert ones (``Shard(0)`` on fsdp) are covered by one
    all-reduce of local sums (see the module docstring).

    With ``optimizer`` a fused ``torch.optim.Adam`` / ``AdamW`` (``fused=True`` in every parameter group) the
    gradients are not multiplied here: ``optimizer.grad_scale`` is set to ``1 / scale`` (a float32 scalar tensor),
    which the fused kernel of the next ``optimizer.step()`` divides every gradient by (and writes the clipped
    gradient back), so the step is the same as after an in-place clip without a pass of its own. Until that step
    ``p.grad`` holds the unclipped gradients. The hand-over is for that one step: a step post-hook removes
    ``grad_scale`` again, and a step pre-hook raises ``RuntimeError`` if the gradients were replaced or modified
    in place after the clip, or ``grad_scale`` was replaced (``torch.amp.GradScaler``: clip without
    ``optimizer`` there). Any other optimizer (foreach, for-loop, other classes) gets the in-place multiply as
    without the argument.

    Args:
        parameters: a sharded model or its parameters.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise when the total norm is nan or inf.
        group: the process group spanning the world; defaults to the default group.
        optimizer: the optimizer whose next ``step()`` updates these parameters; a fused Adam/AdamW applies the
            clipping itself. It must update exactly the parameters with gradients among ``parameters``
            (``ValueError`` otherwise).

    Returns:
        The total norm before clipping (float32 scalar, equal on every rank).
    """
    params = _params(parameters)
    total = get_total_norm(params, norm_type, group=group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); pass "
            "error_if_nonfinite=False to clip anyway"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if optimizer is not None and _applies_grad_scale(optimizer):
        _hand_to_optimizer(optimizer, params, clip_coef)
        return total
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in _locals([p.grad for p in params if p.grad is not None]):
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, clip_coef.to(device))
    for _, pg in pending_grads(params):  # applied by their fused update
        pg.mult = clip_coef.clone() if pg.mult is None else pg.mult * clip_coef.to(pg.mult.device)
    return total


# ---- the clip coefficient handed to a fused Adam/AdamW --------------------------------------------------------
# torch's Adam/AdamW.step() passes ``getattr(self, "grad_scale", None)`` to the fused kernel, which divides each
# gradient by it (and stores the result back into .grad); ``found_inf`` stays unset (None: no step is skipped).
_PENDING = "_moeshard_clip_pending"  # (the grad_scale tensor, fingerprint of the gradients it belongs to)
_HOOKS = "_moeshard_clip_hooks"


def _applies_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def _grads_fingerprint(optimizer: torch.optim.Optimizer) -> list[tuple[weakref.ref, int, int]]:
    # The gradient objects and their version counters (a DTensor and its local tensor count in-place ops
    # separately): a zero_grad, a new backward or an in-place change between the clip and the step shows.
    out = []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        g = p.grad
        if g is not None:
            local = g._local_tensor if isinstance(g, DTensor) else g
            out.append((weakref.ref(g), g._version, local._version))
    out.extend((weakref.ref(pg.local), pg.local._version, id(pg.mult)) for _, pg in pending_grads(params))
    return out


def _same_grads(optimizer: torch.optim.Optimizer, recorded: list[tuple[weakref.ref, int, int]]) -> bool:
    now = _grads_fingerprint(optimizer)
    return len(now) == len(recorded) and all(
        ref() is r() and v == rv and lv == rlv for (ref, v, lv), (r, rv, rlv) in zip(now, recorded, strict=True)
    )


def _hand_to_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], clip_coef: torch.Tensor) -> None:
    clipped = {id(p) for p in params if p.grad is not None}
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    if clipped != stepped:
        raise ValueError(
            f"clip_grad_norm_(..., optimizer=...): the optimizer steps {len(stepped - clipped)} parameter(s) with "
            f"gradients that are not clipped here and {len(clipped - stepped)} clipped one(s) it does not step; "
            "pass the optimizer only when it updates exactly the clipped parameters, or clip without it"
        )
    current = getattr(optimizer, "grad_scale", None)
    pending = getattr(optimizer, _PENDING, None)
    if current is not None and (pending is None or current is not pending[0]):
        raise ValueError(
            "clip_grad_norm_(..., optimizer=...): the optimizer already has a grad_scale set by other code "
            "(torch.amp.GradScaler?); clip without optimizer= there"
        )
    if not hasattr(optimizer, _HOOKS):
        setattr(
            optimizer,
            _HOOKS,
            (optimizer.register_step_pre_hook(_check_pending), optimizer.register_step_post_hook(_clear_pending)),
        )
    devices = {g.device for g in _locals([p.grad for p in params if p.grad is not None])}
    # The optimizer copies grad_scale to each gradient device. Keep it on the CPU when CPU gradients are among them:
    # the CPU kernel reads it on the host, and a non-blocking device-to-host copy may not have landed by then.
    if not devices:
        device = clip_coef.device
    elif any(d.type == "cpu" for d in devices):
        device = torch.device("cpu")
    else:
        device = next(iter(devices))
    scale = torch.reciprocal(clip_coef).to(device=device, dtype=torch.float32)
    # A second clip before the step replaces the first hand-over (same gradients: the same coefficient).
    optimizer.grad_scale = scale
    setattr(optimizer, _PENDING, (scale, _grads_fingerprint(optimizer)))


def _check_pending(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    pending = getattr(optimizer, _PENDING, None)
    if pending is None:
        return
    scale, recorded = pending
    if getattr(optimizer, "grad_scale", None) is not scale:
        _clear_pending(optimizer, args, kwargs)
        raise RuntimeError(
            "optimizer.grad_scale was replaced after clip_grad_norm_(..., optimizer=...) (torch.amp.GradScaler?): "
            "the clip coefficient would be lost; clip without optimizer= there"
        )
    if not _same_grads(optimizer, recorded):
        _clear_pending(optimizer, args, kwargs)
        raise RuntimeError(
            "the gradients changed (zeroed, replaced or modified in place) between clip_grad_norm_(..., "
            "optimizer=...) and optimizer.step(): the clip coefficient belongs to the old ones and was dropped; "
            "call clip_grad_norm_ after the last change to the gradients"
        )


def _refresh_pending(optimizer: torch.optim.Optimizer) -> None:
    """Pending expert gradients just became ``param.grad`` (another optimizer's step, checked before): take the
    gradients' fingerprint again, so the clip's own check accepts them."""
    pending = getattr(optimizer, _PENDING, None)
    if pending is not None:
        setattr(optimizer, _PENDING, (pending[0], _grads_fingerprint(optimizer)))


def _clear_pending(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    pending = getattr(optimizer, _PENDING, None)
    if pending is None:
        return
    delattr(optimizer, _PENDING)
    if getattr(optimizer, "grad_scale", None) is pending[0]:
        del optimizer.grad_scale
