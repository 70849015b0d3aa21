"""Every function of ``moeshard.models.common._torch_internals`` against the installed torch, on the CPU (a DTensor
over the in-process ``fake`` backend: one rank of four). Where torch moved an internal, the function raises the
line naming torch's version and that internal, which is this test's failure message."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moeshard.meshes import fake_process_group
from moeshard.models.common import _torch_internals as ti


def test_every_internal_is_where_it_is_read():
    with fake_process_group(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2))
        # rank 2 is (1, 0) on the 2 x 2 mesh: second half of dim 0, the whole of dim 1
        param = DTensor.from_local(torch.zeros(5, 3), mesh, [Shard(0), Replicate()], run_check=False)
        assert param.shape == (10, 3) and dist.get_rank() == 2
        assert ti.shard_offset(param) == (5, 0)
    (a, b) = ti.foreach_mul([torch.ones(2), torch.full((3,), 2.0)], torch.tensor(1.5))
    assert torch.equal(a, torch.full((2,), 1.5)) and torch.equal(b, torch.full((3,), 3.0))
