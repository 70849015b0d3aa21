"""The shared ``parallelize`` on Qwen3-MoE: the plan at world 16 (fake backend, meta model). Its options, every
option's plan and its numbers on gloo are ``moeshard.models.common``'s tests (on its toy family)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.models.common import ParallelOptions, parallelize
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_plan_at_world_16_experts_on_dim_1_the_dense_layer_alone(tiny_hf_config):
    with fake_process_group(16, rank=13):
        meshes = build_meshes(ep_size=4, ranks_per_node=8, device_type="cpu")
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(tiny_hf_config())  # 3 layers, layer 1 dense; 8 experts, D 64, F 32
        keys = list(model.state_dict())
        par = parallelize(model, meshes, ParallelOptions())
        assert list(model.state_dict()) == keys
        assert (par.ep_info.ep_size, par.ep_info.ep_rank) == (4, 1)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            if ".mlp.experts." in name:
                assert param.device_mesh.mesh_dim_names == ("ep_fsdp",) and param.placements == (Shard(1),), name
                assert param.shape[0] == 8 // 4 and param.to_local().shape[1] == param.shape[1] // 4, name
            else:  # attention with its q/k norms, the dense MLP, routers: plain FSDP over all 16 ranks
                assert param.device_mesh.mesh_dim_names == ("fsdp",) and param.placements == (Shard(0),), name
        stages = [[fqn for fqn, _ in stage.modules] for stage in par.units.stages]
        assert stages == [
            ["model.embed_tokens"],
            ["model.layers.0", "model.layers.0.mlp.experts"],
            ["model.layers.1"],
            ["model.layers.2", "model.layers.2.mlp.experts"],
            ["lm_head"],
        ]
