"""Gradient-norm clipping over parameters that live on the two meshes (and plain replicated ones).

Every rank holds disjoint pieces of the gradients:
- a non-expert gradient is a ``Shard(0)`` DTensor over the global ``fsdp`` mesh (all W ranks);
- an expert gradient is a ``Shard(1)`` DTensor over one ``ep_fsdp`` group, and the ep ranks outside that group
  hold *other* experts (EP on dim 0), so its pieces are spread over ep_fsdp x ep = all W ranks as well.
So the global ``sum |g|^p`` is the sum over the world of each rank's local sums: one all-reduce, no
``full_tensor()``, nothing counted twice. Plain (non-DTensor) gradients are copies on every rank and are added
once, after the all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

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


def _local_norms(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    out = []
    for ts in by_device.values():
        # Norms in float32 whatever the gradient dtype, as the reduction of a global norm must be.
        out.extend(n for n in torch._foreach_norm(ts, norm_type, dtype=torch.float32))
    return out


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
    grads = [p.grad for p in _params(parameters) if p.grad is not None]
    dev = _comm_device(group) if dist.is_initialized() else (grads[0].device if grads else torch.device("cpu"))
    if not dist.is_initialized():  # one process: nothing to reduce
        return _finish(_reduce(_local_norms(_locals(grads), norm_type), norm_type, dev), norm_type)
    sharded, replicated = _split(grads, dist.get_world_size(group))
    total = _reduce(_local_norms(sharded, norm_type), norm_type, dev)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    rep = _reduce(_local_norms(replicated, norm_type), norm_type, dev)
    total = torch.maximum(total, rep) if math.isinf(norm_type) else total + rep
    return _finish(total, norm_type)


def _locals(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


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
) -> torch.Tensor:
    """Clip gradients in place by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    The scale is ``min(1, max_norm / (total_norm + 1e-6))``, applied to every rank's local pieces; expert
    gradients (``Shard(1)`` on ep_fsdp) and non-expert ones (``Shard(0)`` on fsdp) are covered by one
    all-reduce of local sums (see the module docstring).

    Args:
        parameters: a sharded model or its parameters.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise when the total norm is nan or inf.
        group: the process group spanning the world; defaults to the default group.

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
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in _locals([p.grad for p in params if p.grad is not None]):
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, clip_coef.to(device))
    return total
