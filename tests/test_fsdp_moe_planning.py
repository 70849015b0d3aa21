"""Qwen3-MoE 30B-A3B sharded by moeshard.fsdp_moe's shard_model, planned on the fake backend (one process, no
communication): DESIGN.md's worked example (2 nodes x 8, EP 8) and 1 node x 8 at EP 8 (experts kept out of FSDP).
A cross-package test: fsdp_moe with the model package."""

import pytest
import torch
from torch.distributed.tensor import Shard

from moeshard.meshes import build_meshes, fake_process_group


def _plan(preset, world, rank, ep, **overrides):
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    with fake_process_group(world, rank):
        meshes = build_meshes(ep_size=ep, ranks_per_node=8, device_type="cpu")
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(get_preset_config(preset, **overrides))
        ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
        units = shard_model(model, meshes, ep_info=ep_info)
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
