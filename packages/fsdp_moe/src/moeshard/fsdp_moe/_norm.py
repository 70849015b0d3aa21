"""The global p-norm of gradients that live on the two meshes (and plain replicated ones).

Every rank holds disjoint pieces of the gradients:
- a non-expert gradient is a ``Shard(0)`` DTensor over the global ``fsdp`` mesh (all W ranks);
- an expert gradient is a ``Shard(1)`` DTensor over one ``ep_fsdp`` group, and the ep ranks outside that group
  hold *other* experts (EP on dim 0), so its pieces are spread over ep_fsdp x ep = all W ranks as well.
So the global ``sum |g|^p`` is the sum over the world of each rank's local sums: one all-reduce, no
``full_tensor()``, nothing counted twice. Plain (non-DTensor) gradients are copies on every rank and are added
once, after the all-reduce. The shared core of ``clip_grad_norm_`` / ``get_total_norm`` and of
``OptimizersContainer.clip_grad_norm_``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from moeshard.fsdp_moe._torch_internals import foreach_mul_, foreach_norm
from moeshard.meshes import MeshAxis

__all__ = ["check_norm_type", "comm_device", "local_norms", "multiply_grads_", "reduce_norms", "split_grads"]


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    return norm_type


def split_grads(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[list, list]:
    """(this rank's pieces of gradients sharded over the world, replicated gradients counted once) as local
    tensors; without a process group everything is this process's own."""
    if not dist.is_initialized():
        return [g.to_local() if isinstance(g, DTensor) else g for g in grads], []
    world = dist.get_world_size(group)
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


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_norms(tensors: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """The p-norm of each local tensor, in float32 whatever its dtype (one foreach call per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    out = []
    for ts in by_device.values():
        out.extend(foreach_norm(ts, norm_type, dtype=torch.float32))
    return out


def _reduce(norms: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device) for n in norms])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()


def reduce_norms(
    sharded: list[torch.Tensor],
    replicated: list[torch.Tensor],
    norm_type: float,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The global p-norm from local norms: ``sharded`` summed (p-th powers) over the world in one all-reduce,
    ``replicated`` added once after it. A float32 scalar tensor (on the GPU with NCCL, else on the CPU; without a
    process group on the first norm's device), the same on every rank; no host sync."""
    if not dist.is_initialized():  # one process: nothing to reduce
        first = (sharded + replicated)[0].device if sharded or replicated else torch.device("cpu")
        return _finish(_reduce(sharded + replicated, norm_type, first), norm_type)
    device = comm_device(group)
    total = _reduce(sharded, norm_type, device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    rep = _reduce(replicated, norm_type, device)
    total = torch.maximum(total, rep) if math.isinf(norm_type) else total + rep
    return _finish(total, norm_type)


def _finish(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def multiply_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply gradients (DTensors or plain tensors) in place by the scalar tensor ``coef``: their local tensors,
    one foreach call per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        by_device.setdefault(local.device, []).append(local)
    for device, gs in by_device.items():
        foreach_mul_(gs, coef.to(device))
