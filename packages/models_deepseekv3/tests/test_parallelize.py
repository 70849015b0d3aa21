"""The shared ``parallelize`` on DeepSeek-V3: the plan at world 16 (fake backend, meta model). Its numbers on gloo
(2 nodes x 2 ranks, EP 2 x ep_fsdp 2, against transformers in one process) are the app's DeepSeek-V3 job test
(``apps/train/tests/test_deepseek_job.py``: losses and gradient norms over 4 steps, and a resume at EP 4)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.models.common import ParallelOptions, parallelize
from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM, get_preset_config


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_plan_at_world_16_experts_on_dim_1_shared_experts_in_their_layer():
    config = get_preset_config("deepseek-v3-16b", num_hidden_layers=3)  # 1 dense layer, 2 MoE layers
    with fake_process_group(16, rank=13):
        meshes = build_meshes(ep_size=8, ranks_per_node=8, device_type="cpu")
        with torch.device("meta"):
            model = DeepseekV3ForCausalLM(config)
        keys = list(model.state_dict())
        par = parallelize(model, meshes, ParallelOptions(activation_checkpointing="full"))
        assert list(model.state_dict()) == keys
        assert (par.ep_info.ep_size, par.ep_info.ep_rank) == (8, 5)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            if ".mlp.experts." in name:
                assert param.device_mesh.mesh_dim_names == ("ep_fsdp",) and param.placements == (Shard(1),), name
                assert param.shape[0] == 64 // 8 and param.to_local().shape[1] == param.shape[1] // 2, name
            else:  # MLA, the dense MLP, shared experts, routers: plain FSDP over all 16 ranks
                assert param.device_mesh.mesh_dim_names == ("fsdp",) and param.placements == (Shard(0),), name
        stages = [[fqn for fqn, _ in stage.modules] for stage in par.units.stages]
        assert stages == [
            ["model.embed_tokens"],
            ["model.layers.0"],
            ["model.layers.1", "model.layers.1.mlp.experts"],
            ["model.layers.2", "model.layers.2.mlp.experts"],
            ["lm_head"],
        ]
