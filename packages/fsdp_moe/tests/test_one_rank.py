"""``reduce_in_place_on_one_rank``: on a one-rank mesh FSDP2's reduce-scatter output is its input buffer (no copy),
and the gradients are FSDP2's own bit for bit: bf16 compute with float32 reduction, micro-batches accumulated
unsharded, and a second reducing backward added into the sharded gradient (1 gloo rank). The comm's buffer rule
and the source check that guards it, without a process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeshard.fsdp_moe import _one_rank
from moeshard.fsdp_moe._one_rank import OneRankReduceScatter
from moeshard.meshes.testing import run_distributed


def _grads(in_place: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moeshard.fsdp_moe._one_rank import reduce_in_place_on_one_rank
    from moeshard.fsdp_moe._torch_internals import fsdp_param_groups, reduce_scatter_comm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3))
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [fully_shard(model[i], mesh=mesh, mp_policy=mp) for i in (0, 2)]
    root = fully_shard(model, mesh=mesh, mp_policy=mp)
    installed = [in_place and reduce_in_place_on_one_rank(m) for m in (*units, root)]
    x = torch.randn(3, 6, 8)
    out = {"installed": installed, "grads": []}
    # Step 1: two micro-batches, the first without reducing (FSDP2 holds float32 sums), the second reducing.
    # Step 2, without zero_grad: one reducing backward, added into the sharded gradients.
    for syncs in ((False, True), (True,)):
        for i, sync in enumerate(syncs):
            model.set_requires_gradient_sync(sync)
            model(x[i]).square().sum().backward()
        out["grads"].append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
    comms = [reduce_scatter_comm(fsdp_param_groups(m)[0]) for m in (*units, root)]
    out["reused"] = [getattr(comm, "reused", None) for comm in comms]
    return out


def test_gradients_are_fsdp2s_without_the_copy():
    plain, in_place = (run_distributed(_grads, 1, flag)[0] for flag in (False, True))
    assert plain["installed"] == [False] * 3
    assert in_place["installed"] == [True] * 3
    # Each unit reduced twice, each time into the buffer it had copied its gradients into.
    assert in_place["reused"] == [2, 2, 2], in_place["reused"]
    for step_plain, step_in_place in zip(plain["grads"], in_place["grads"]):
        assert step_plain.keys() == step_in_place.keys()
        for name, grad in step_plain.items():
            assert torch.equal(grad, step_in_place[name]), name


def test_the_output_is_the_input_just_handed_out():
    comm = OneRankReduceScatter()
    first = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu")) is first and comm.reused == 1
    # Once only: the next request is a new input.
    assert comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu")) is not first
    # Another size or dtype is never the pending buffer.
    comm = OneRankReduceScatter()
    first = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((3,), dtype=torch.float32, device=torch.device("cpu")) is not first
    comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    assert comm.allocate((6,), dtype=torch.bfloat16, device=torch.device("cpu")).dtype == torch.bfloat16
    assert comm.reused == 0


def test_another_order_of_foreach_reduce_changes_nothing(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    def foreach_reduce(*args, **kwargs):  # an output asked of the comm with no input before it
        reduce_output = reduce_scatter_comm.allocate((1,))  # noqa: F821
        reduce_output.copy_(reduce_scatter_input)  # noqa: F821

    _one_rank._order_holds.cache_clear()
    try:
        assert _one_rank._order_holds()  # the installed torch's order
        monkeypatch.setattr(_fsdp_collectives, "foreach_reduce", foreach_reduce)
        _one_rank._order_holds.cache_clear()
        assert not _one_rank._order_holds()
    finally:
        monkeypatch.undo()
        _one_rank._order_holds.cache_clear()


def test_refuses_a_module_without_fsdp():
    from moeshard.fsdp_moe._one_rank import reduce_in_place_on_one_rank

    with pytest.raises(TypeError, match="not an FSDP unit"):
        reduce_in_place_on_one_rank(nn.Linear(2, 2))
