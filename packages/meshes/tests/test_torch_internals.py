"""``moeshard.meshes._torch_internals.fake_store`` (the one private part of torch this package reads) against the
installed torch: the ``fake`` backend plans a world of 16 in this process. Where torch moved it, the function
raises the line naming torch's version and the internal, which is this test's failure message."""

from __future__ import annotations

import torch.distributed as dist

from moeshard.meshes import _torch_internals as ti


def test_the_fake_backend_is_where_it_is_read():
    dist.init_process_group("fake", store=ti.fake_store(), rank=3, world_size=16)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (3, 16)
    finally:
        dist.destroy_process_group()
