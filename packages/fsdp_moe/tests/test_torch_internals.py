"""Every function of ``moeshard.fsdp_moe._torch_internals`` (the one place this package reads torch's private
parts) against the installed torch, on a tiny FSDP2 model over the in-process ``fake`` backend (one rank, no
communication). Where torch moved an internal, the function raises the line naming torch's version and that
internal, which is this test's failure message."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from moeshard.fsdp_moe import _torch_internals as ti
from moeshard.meshes import fake_process_group

# The line every function raises where its internal is gone: torch's version, what moved, and who reads it.
_MOVED = r"^torch {v}: {what} \(used by moeshard\.fsdp_moe\._torch_internals\.{fn}\)$"


def _moved(what: str, fn: str) -> str:
    return _MOVED.format(v=re.escape(torch.__version__), what=re.escape(what), fn=fn)


def test_every_internal_is_where_it_is_read():
    with fake_process_group(1):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        fully_shard(model[0])
        fully_shard(model)
        groups = ti.fsdp_param_groups(model[0])
        assert len(groups) == 1 and ti.fsdp_param_groups(model) != []
        fsdp_params = groups[0].fsdp_params
        assert [ti.unsharded_param(p) for p in fsdp_params] == [None, None]  # not gathered yet
        seen = []
        model[0].register_forward_pre_hook(lambda m, args: seen.extend(ti.unsharded_param(p) for p in fsdp_params))
        model(torch.randn(3, 4)).sum().backward()
        assert [tuple(t.shape) for t in seen] == [(6, 4), (6,)]  # what the forward computed with
        assert type(ti.reduce_scatter_comm(groups[0])).__name__ == "DefaultReduceScatter"
        held = torch.zeros(6, 4)
        if ti.keeps_held_grad(fsdp_params[0]):  # torch 2.11, 2.13: FSDP2 holds a reduce-dtype gradient
            assert ti.held_grad(fsdp_params[0]) is None  # none held after a reducing backward
            ti.set_held_grad(fsdp_params[0], held)
            assert ti.held_grad(fsdp_params[0]) is held
            ti.set_held_grad(fsdp_params[0], None)
        else:  # torch 2.15: autograd accumulates in the reduce dtype; asking for the held gradient names that
            with pytest.raises(
                RuntimeError, match=_moved("FSDPParam no longer has unsharded_accumulated_grad", "held_grad")
            ):
                ti.held_grad(fsdp_params[0])
        assert issubclass(ti.reduce_scatter_base(), object) and ti.reduce_scatter_base() is not object
        weight = model[0].weight
        assert isinstance(weight, DTensor)
        local = ti.local_tensor(weight)
        assert local.data_ptr() == ti.local_tensor(weight).data_ptr() and local.shape == (6, 4)
        grad = weight.grad
        assert isinstance(grad, DTensor) and type(ti.local_tensor(grad)) is torch.Tensor
        assert ti.local_tensor(grad) is ti.local_tensor(grad)  # a gradient's own local tensor, every call
    assert "reduce_scatter_comm.allocate(" in ti.foreach_reduce_source()
    t = torch.ones(3)
    before = ti.tensor_version(t)
    ti.foreach_mul_([t], torch.tensor(2.0))
    assert ti.tensor_version(t) > before and torch.equal(t, torch.full((3,), 2.0))
    (norm,) = ti.foreach_norm([t], 2.0, dtype=torch.float32)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(t))
    assert ti.tree_map_only(torch.Tensor, lambda x: x + 1, {"a": (t, 3)})["a"][1] == 3


def test_a_moved_internal_is_named_with_torchs_version():
    class Stand:  # an object of a torch that dropped what is read from it
        pass

    with pytest.raises(RuntimeError, match=_moved("Stand no longer has _reduce_scatter_comm", "reduce_scatter_comm")):
        ti.reduce_scatter_comm(Stand())
    with pytest.raises(RuntimeError, match=_moved("Stand no longer has _unsharded_param", "unsharded_param")):
        ti.unsharded_param(Stand())
    with pytest.raises(RuntimeError, match=_moved("FSDPModule no longer has _get_fsdp_state", "fsdp_param_groups")):
        ti.fsdp_param_groups(Stand())
    state = Stand()
    unit = Stand()
    unit._get_fsdp_state = lambda: state
    what = "FSDPState has neither _fsdp_param_groups nor _fsdp_param_group"
    with pytest.raises(RuntimeError, match=_moved(what, "fsdp_param_groups")):
        ti.fsdp_param_groups(unit)
