"""What shard_model refuses (gloo, 2 processes), and shard shapes planned for 16 ranks on the fake backend."""

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Shard

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import run_distributed


def _refusals():
    from torch import nn

    from moeshard.ep import ParallelPlan, apply_ep
    from moeshard.fsdp_moe import clip_grad_norm_, shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM
    from moeshard.meshes import plan_layout

    ep2 = build_meshes(ep_size=2)  # EP 2 x ep_fsdp 1
    ep1 = build_meshes(ep_size=1)  # EP 1 x ep_fsdp 2

    with pytest.raises(ValueError, match=r"no expert parallelism applied but meshes.ep_size is 2.*apply_ep"):
        shard_model(ToyMoELM(), ep2)

    other_world = dataclasses.replace(ep1, layout=plan_layout(8, 8, 1))
    with pytest.raises(ValueError, match=r"world of 8.*rank \d of 2.*build_meshes"):
        shard_model(ToyMoELM(), other_world)

    model = ToyMoELM()
    apply_ep(model, model.get_parallel_plan(), ep2.ep)
    with pytest.raises(ValueError, match=r"EP was applied with EP size 2.*meshes have EP size 1"):
        shard_model(model, ep1)

    # down_proj [E, D=15, F]: dim 1 does not split over ep_fsdp 2 (FSDP2 shards a non-zero dim evenly only).
    with pytest.raises(
        ValueError, match=r"down_proj \(8, 15, 8\): dim 1 \(size 15\) is not divisible by the ep_fsdp size 2"
    ):
        shard_model(ToyMoELM(hidden=15), ep1)

    model = ToyMoELM()
    model.layers[0].experts.bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"layers.0.experts.bias, which the EP plan does not shard"):
        shard_model(model, ep1)

    bad_plan = dataclasses.replace(ToyMoELM().get_parallel_plan(), fsdp_units=("embed", "blocks.*"))
    with pytest.raises(ValueError, match=r"'blocks.\*' matches no module"):
        shard_model(ToyMoELM(), ep1, plan=bad_plan)
    expert_unit = ParallelPlan(ToyMoELM().get_parallel_plan().ep_plan, fsdp_units=("layers.*.experts",))
    with pytest.raises(ValueError, match=r"matches layers.0.experts, an expert module"):
        shard_model(ToyMoELM(), ep1, plan=expert_unit)

    # EP size 1 needs no apply_ep: shard_model records the metadata; a second call is refused.
    model = ToyMoELM()
    units = shard_model(model, ep1)
    assert [s.name for s in units.stages] == ["embed", "layers.0", "layers.1", "head"]
    with pytest.raises(ValueError, match="already has FSDP applied"):
        shard_model(model, ep1)

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


def _plan(preset, world, rank, ep, **overrides):
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    with fake_process_group(world, rank):
        meshes = build_meshes(ep_size=ep, ranks_per_node=8, device_type="cpu")
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(get_preset_config(preset, **overrides))
        apply_ep(model, model.get_parallel_plan(), meshes.ep)
        units = shard_model(model, meshes)
        params = {
            n: (tuple(p.to_local().shape), p.placements, p.device_mesh.mesh.tolist())
            for n, p in model.named_parameters()
        }
        return units, params


@pytest.mark.parametrize("rank", [0, 13])
def test_worked_example_two_nodes_of_eight(rank):
    """DESIGN.md's example: 2 nodes x 8, EP 8: 16 experts per EP rank, down_proj [16, 2048, 768] split on dim 1
    over the ep_fsdp pair {r, r + 8} -> [16, 1024, 768]; non-expert parameters over all 16 ranks."""
    units, params = _plan("qwen3-30b-a3b", 16, rank, 8, num_hidden_layers=2)
    local, placements, mesh = params["model.layers.1.mlp.experts.down_proj"]
    assert (local, placements, mesh) == ((16, 1024, 768), (Shard(1),), [rank % 8, rank % 8 + 8])
    assert params["model.layers.0.mlp.experts.gate_up_proj"][0] == (16, 768, 2048)
    local, placements, mesh = params["model.layers.0.self_attn.q_proj.weight"]
    assert (local, placements, mesh) == ((4096 // 16, 2048), (Shard(0),), list(range(16)))
    assert [[n for n, _ in s.modules] for s in units.stages] == [
        ["model.embed_tokens"],
        ["model.layers.0", "model.layers.0.mlp.experts"],
        ["model.layers.1", "model.layers.1.mlp.experts"],
        ["lm_head"],
    ]
    assert "model.layers.0.mlp.experts [ep_fsdp x2]" in units.describe()


def test_ep_over_the_whole_world_keeps_experts_out_of_fsdp():
    """1 node x 8, EP 8: ep_fsdp has one rank, so the experts get no FSDP unit; their parameters are still
    ``Shard(1)`` DTensors on the one-rank ep_fsdp mesh (16 experts per rank, nothing split on dim 1)."""
    units, params = _plan("qwen3-30b-a3b", 8, 3, 8, num_hidden_layers=2)
    local, placements, mesh = params["model.layers.1.mlp.experts.down_proj"]
    assert (local, placements, mesh) == ((16, 2048, 768), (Shard(1),), [3])
    local, placements, mesh = params["model.layers.0.self_attn.q_proj.weight"]
    assert (local, placements, mesh) == ((4096 // 8, 2048), (Shard(0),), list(range(8)))
    assert [[n for n, _ in s.modules] for s in units.stages] == [
        ["model.embed_tokens"],
        ["model.layers.0"],
        ["model.layers.1"],
        ["lm_head"],
    ]
    experts = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert units.experts == () and [n for n, _ in units.local_experts] == experts
    assert [s.local_experts for s in units.stages] == [(), (experts[0],), (experts[1],), ()]
    assert "model.layers.0: model.layers.0 [fsdp x8], model.layers.0.mlp.experts [ep_fsdp x1, no FSDP]" in (
        units.describe()
    )
