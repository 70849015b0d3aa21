"""A world of one (gloo, in this process) for the package's tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
