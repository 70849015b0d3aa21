"""What shard_model refuses (gloo, 2 processes). (Shard shapes of Qwen3-MoE planned for 16 ranks on the fake
backend: tests/test_fsdp_moe_planning.py.)"""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Shard

from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed


def _refusals():
    from torch import nn

    from moeshard.ep import ParallelPlan, apply_ep
    from moeshard.fsdp_moe import clip_grad_norm_, shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM
    from moeshard.meshes import plan_layout

    ep2 = build_meshes(ep_size=2)  # EP 2 x ep_fsdp 1
    ep1 = build_meshes(ep_size=1)  # EP 1 x ep_fsdp 2

    with pytest.raises(ValueError, match=r"shard_model: the plan's EP part was not applied: call ep_info = "):
        shard_model(ToyMoELM(), ep2)
    with pytest.raises(ValueError, match=r"the plan's EP part was not applied"):  # EP size 1 too: never applied here
        shard_model(ToyMoELM(), ep1)

    def ep1_info(model):
        return apply_ep(model, model.get_parallel_plan(), None)

    other_world = dataclasses.replace(ep1, layout=plan_layout(8, 8, 1))
    with pytest.raises(ValueError, match=r"world of 8.*rank \d of 2.*build_meshes"):
        shard_model(ToyMoELM(), other_world)
    with pytest.raises(ValueError, match=r"expert_reduce_dtype=torch.float16 is not allowed: torch.float32, torch"):
        shard_model(ToyMoELM(), ep1, expert_reduce_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"expert_reshard_after_forward=1 is not allowed: True, False or None"):
        shard_model(ToyMoELM(), ep1, expert_reshard_after_forward=1)

    model = ToyMoELM()
    info = apply_ep(model, model.get_parallel_plan(), ep2.ep)
    with pytest.raises(ValueError, match=r"EP was applied with EP size 2.*meshes have EP size 1"):
        shard_model(model, ep1, ep_info=info)
    with pytest.raises(ValueError, match=r"expert modules of this EPInfo are not in this ToyMoELM"):
        shard_model(ToyMoELM(), ep2, ep_info=info)

    # down_proj [E, D=15, F]: dim 1 does not split over ep_fsdp 2 (FSDP2 shards a non-zero dim evenly only).
    with pytest.raises(
        ValueError, match=r"down_proj \(8, 15, 8\): dim 1 \(size 15\) is not divisible by the ep_fsdp size 2"
    ):
        model = ToyMoELM(hidden=15)
        shard_model(model, ep1, ep_info=ep1_info(model))

    model = ToyMoELM()
    info = ep1_info(model)
    model.layers[0].experts.bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"layers.0.experts.bias, which the EP plan does not shard"):
        shard_model(model, ep1, ep_info=info)

    bad_plan = dataclasses.replace(ToyMoELM().get_parallel_plan(), fsdp_units=("embed", "blocks.*"))
    with pytest.raises(ValueError, match=r"'blocks.\*' matches no module"):
        model = ToyMoELM()
        shard_model(model, ep1, ep_info=ep1_info(model), plan=bad_plan)
    expert_unit = ParallelPlan(ToyMoELM().get_parallel_plan().ep_plan, fsdp_units=("layers.*.experts",))
    with pytest.raises(ValueError, match=r"matches layers.0.experts, an expert module"):
        model = ToyMoELM()
        shard_model(model, ep1, ep_info=ep1_info(model), plan=expert_unit)

    # EP size 1: apply_ep slices nothing, its EPInfo says where the experts are; a second call is refused.
    model = ToyMoELM()
    info = ep1_info(model)
    units = shard_model(model, ep1, ep_info=info)
    assert [s.name for s in units.stages] == ["embed", "layers.0", "layers.1", "head"]
    with pytest.raises(ValueError, match="already has FSDP applied"):
        shard_model(model, ep1, ep_info=info)

    # A DTensor gradient on a sub-mesh other than ep_fsdp: the clipping cannot know what the other ranks hold.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.ones(4), ep2.ep, [Shard(0)]))  # the ep mesh spans the world here
    p.grad = distribute_tensor(torch.ones(4), ep2.ep, [Shard(0)])
    single = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))["b"]
    q = nn.Parameter(distribute_tensor(torch.ones(4), single, [Shard(0)]))
    q.grad = distribute_tensor(torch.ones(4), single, [Shard(0)])
    with pytest.raises(ValueError, match=r"mesh \('b',\) of 1 ranks in a world of 2"):
        clip_grad_norm_([p, q], 1.0)
    return True


def test_refusals_name_the_problem_and_the_fix():
    assert run_distributed(_refusals, 2) == [True, True]
