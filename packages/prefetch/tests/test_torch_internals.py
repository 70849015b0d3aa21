"""Every function of ``moeshard.prefetch._torch_internals`` (the one place this package reads torch's private
parts) against the installed torch, on a tiny FSDP2 model over the in-process ``fake`` backend (one rank, no
communication). Where torch moved an internal, the function raises the line naming torch's version and that
internal, which is this test's failure message."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from moeshard.meshes import fake_process_group
from moeshard.prefetch import _torch_internals as ti


def test_every_internal_is_where_it_is_read():
    with fake_process_group(1):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        fully_shard(model[0])
        fully_shard(model)
        (group,) = ti.fsdp_param_groups(model[0])
        assert ti.all_gather_result(group) is None  # nothing in flight before the step
        phases = []
        model[0].register_forward_pre_hook(lambda m, args: phases.append(ti.in_backward()))
        out = model(torch.randn(3, 4))
        out.register_hook(lambda g: phases.append(ti.in_backward()))
        out.sum().backward()
        assert phases == [False, True]
        handle = model[0].unshard(async_op=True)  # an all-gather issued: its result pending until waited on
        assert ti.all_gather_result(group) is not None
        handle.wait()
        assert ti.all_gather_result(group) is None
    assert ti.in_backward() is False


def test_a_moved_internal_is_named_with_torchs_version():
    class Stand:  # an object of a torch that dropped what is read from it
        pass

    used_by = r"\(used by moeshard\.prefetch\._torch_internals\.all_gather_result\)$"
    line = rf"^torch {re.escape(torch.__version__)}: Stand no longer has _all_gather_result {used_by}"
    with pytest.raises(RuntimeError, match=line):
        ti.all_gather_result(Stand())
    with pytest.raises(RuntimeError, match=r"FSDPModule no longer has _get_fsdp_state \(used by .*fsdp_param_groups\)"):
        ti.fsdp_param_groups(Stand())
