"""moeshard.meshes: the global FSDP mesh and the expert ``(ep_fsdp, ep)`` mesh for MoE training.

Example (under torchrun)::

    import torch.distributed as dist
    from moeshard.meshes import build_meshes

    dist.init_process_group("gloo")
    meshes = build_meshes(ep_size=2)          # ranks per node from LOCAL_WORLD_SIZE
    print(meshes.describe())
    meshes.ep, meshes.ep_fsdp, meshes.fsdp    # 1-D DeviceMeshes
"""

from moeshard.meshes._build import ParallelMeshes, build_meshes, fake_process_group
from moeshard.meshes._layout import MeshAxis, MeshLayout, plan_layout

__all__ = [
    "MeshAxis",
    "MeshLayout",
    "ParallelMeshes",
    "build_meshes",
    "fake_process_group",
    "plan_layout",
]
