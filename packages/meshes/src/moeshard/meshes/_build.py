"""Building the real DeviceMeshes from the launch, and planning any world size with the ``fake`` backend."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeshard.meshes._layout import MeshAxis, MeshLayout, plan_layout
from moeshard.meshes._torch_internals import fake_store


@dataclass(frozen=True)
class ParallelMeshes:
    """The two meshes of one job and this rank's place in them.

    Attributes:
        layout: the validated rank layout (sizes and groups).
        fsdp: 1-D mesh ``("fsdp",)`` over all ranks, for non-expert parameters (Shard(0)).
        expert: 2-D mesh ``("ep_fsdp", "ep")``, ep innermost, for expert parameters.
        rank: this process's global rank.
        sequence: 2-D mesh ``("dp", "sp")``, sp innermost (consecutive ranks share each row), or None where
            ``sp_size`` is 1.
    """

    layout: MeshLayout
    fsdp: DeviceMesh
    expert: DeviceMesh
    rank: int
    sequence: DeviceMesh | None = None

    @property
    def sp(self) -> DeviceMesh | None:
        """1-D sub-mesh over this rank's sequence group (the attention's all-to-all), or None where ``sp_size`` is 1."""
        return None if self.sequence is None else self.sequence[MeshAxis.SP.value]

    @property
    def sp_size(self) -> int:
        """Sequence-parallel degree: ranks sharing each row."""
        return self.layout.sp_size

    @property
    def sp_rank(self) -> int:
        """This rank's index in its sequence group: the shard of each row it holds."""
        return self.layout.sp_rank_of(self.rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: groups reading different rows (``world_size / sp_size``)."""
        return self.layout.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which rows it reads."""
        return self.layout.dp_rank_of(self.rank)

    @property
    def ep(self) -> DeviceMesh:
        """1-D sub-mesh over this rank's EP group (token all-to-all; experts sharded on dim 0)."""
        return self.expert[MeshAxis.EP.value]

    @property
    def ep_fsdp(self) -> DeviceMesh:
        """1-D sub-mesh over the ranks holding the same experts (experts sharded on dim 1)."""
        return self.expert[MeshAxis.EP_FSDP.value]

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree."""
        return self.layout.ep_size

    @property
    def ep_fsdp_size(self) -> int:
        """Size of the expert FSDP axis."""
        return self.layout.ep_fsdp_size

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.layout.world_size

    @property
    def ep_rank(self) -> int:
        """This rank's index inside its EP group."""
        return self.rank % self.layout.ep_size

    @property
    def ep_fsdp_rank(self) -> int:
        """This rank's index inside its ep_fsdp group."""
        return self.rank // self.layout.ep_size

    @property
    def node_index(self) -> int:
        """Index of the node this rank runs on."""
        return self.layout.node_of(self.rank)

    @property
    def device_type(self) -> str:
        """Device type of the meshes (``"cuda"`` or ``"cpu"``)."""
        return self.fsdp.device_type

    def describe(self) -> str:
        """The layout's description plus this rank's groups."""
        lay = self.layout
        return (
            lay.describe() + f"\n  rank {self.rank} on node {self.node_index}: ep group {lay.ep_group_of(self.rank)}, "
            f"ep_fsdp group {lay.ep_fsdp_group_of(self.rank)}"
            + (f", sp group {lay.sp_group_of(self.rank)}" if lay.sp_size > 1 else "")
        )


def default_device_type() -> str:
    """``"cuda"`` when a GPU is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def ranks_per_node_from_env(world_size: int) -> int:
    """Ranks per node from ``LOCAL_WORLD_SIZE`` (set by torchrun); one node when unset."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return world_size
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {value!r}") from None


def _backend_for(device_type: str) -> str:
    """The default group's backend for ``device_type`` (``"nccl"`` from ``"cuda:nccl,cpu:gloo"``)."""
    backend = str(dist.get_backend())
    for part in backend.split(","):
        dev, _, name = part.rpartition(":")
        if dev == device_type:
            return name
    return backend


def build_meshes(
    ep_size: int,
    *,
    device_type: str | None = None,
    ranks_per_node: int | None = None,
    allow_cross_node_ep: bool = False,
    sp_size: int = 1,
) -> ParallelMeshes:
    """Build the global ``(fsdp,)`` mesh and the expert ``(ep_fsdp, ep)`` mesh for this process.

    Needs an initialised default process group (``torch.distributed.init_process_group``; the ``fake`` backend
    works for planning). A single process is a world of one.

    Args:
        ep_size: expert-parallel degree (ranks sharing one layer's experts on dim 0).
        device_type: mesh device type; defaults to ``"cuda"`` when available, else ``"cpu"``.
        ranks_per_node: ranks per node; defaults to ``LOCAL_WORLD_SIZE`` or, unset, the whole world.
        allow_cross_node_ep: accept EP groups that span nodes.
        sp_size: sequence-parallel degree (ranks sharing each row; consecutive, inside a node).

    Raises:
        ValueError: the sizes do not fit (see :func:`plan_layout`).
        RuntimeError: no process group is initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "build_meshes needs an initialised process group: call torch.distributed.init_process_group "
            "(torchrun sets the environment), or use fake_process_group() to plan without communication"
        )
    world_size = dist.get_world_size()
    if ranks_per_node is None:
        ranks_per_node = ranks_per_node_from_env(world_size)
    layout = plan_layout(world_size, ranks_per_node, ep_size, allow_cross_node_ep=allow_cross_node_ep, sp_size=sp_size)
    device_type = device_type or default_device_type()
    fsdp = init_device_mesh(device_type, (world_size,), mesh_dim_names=(MeshAxis.FSDP.value,))
    # The expert mesh's groups get communicators of their own even where a group spans the whole world (EP 8 on
    # one node of 8, EP 2 on 2 GPUs): DeviceMesh would otherwise hand out the default group, which FSDP uses,
    # and NCCL runs one communicator's operations in issue order, so the EP exchange of a layer would queue
    # behind FSDP's reduce-scatter of another layer's gradients (waits seen in traces: docs/performance.md).
    backend = _backend_for(device_type)
    expert = init_device_mesh(
        device_type,
        (layout.ep_fsdp_size, layout.ep_size),
        mesh_dim_names=(MeshAxis.EP_FSDP.value, MeshAxis.EP.value),
        backend_override={MeshAxis.EP_FSDP.value: backend, MeshAxis.EP.value: backend},
    )
    sequence = None
    if layout.sp_size > 1:  # the attention's all-to-all gets communicators of its own, as the EP exchange does
        sequence = init_device_mesh(
            device_type,
            (layout.dp_size, layout.sp_size),
            mesh_dim_names=(MeshAxis.DP.value, MeshAxis.SP.value),
            backend_override={MeshAxis.DP.value: backend, MeshAxis.SP.value: backend},
        )
    return ParallelMeshes(layout=layout, fsdp=fsdp, expert=expert, rank=dist.get_rank(), sequence=sequence)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise the ``fake`` backend as rank ``rank`` of ``world_size``: groups and shapes, no communication.

    Use it to plan layouts no machine here has (``build_meshes`` and ``fully_shard`` work inside; collectives
    return without moving data). The previous state (no process group) is restored on exit.
    """
    if dist.is_initialized():
        raise RuntimeError("fake_process_group needs no process group to be initialised already")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
