"""The shared ``parallelize`` on DeepSeek-V3: the plan at world 16 (fake backend, meta model) and, on gloo, 2 nodes x 2
ranks at EP 2 x ep_fsdp 2 equal to transformers in one process (the loss and every gradient)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import run_distributed
from moeshard.models.common import ParallelOptions, load_hf_config, load_hf_weights, parallelize
from moeshard.models.deepseekv3 import DEEPSEEK_V3_FORMAT, DeepseekV3ForCausalLM, get_preset_config


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


def _parallel_step(path, ids_RBS):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(load_hf_config(path, DEEPSEEK_V3_FORMAT))
    par = parallelize(model, meshes, ParallelOptions(activation_checkpointing="full"))
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    n_global = ids_RBS.shape[0] * ids_RBS.shape[1] * (ids_RBS.shape[2] - 1)
    ids = ids_RBS[rank]
    loss = model(ids, labels=ids, num_items_in_batch=n_global / world, output_router_logits=False).loss
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    experts = {fqn: (m.expert_start, m.expert_end) for fqn, m in par.ep_info.params.items()}
    return loss.detach(), grads, experts


def test_two_nodes_of_two_at_ep_2_equal_transformers_in_one_process(hf_dir, load_reference):
    ids_RBS = torch.randint(1, 512, (4, 2, 10), generator=torch.Generator().manual_seed(3))
    ref = load_reference(hf_dir)
    all_ids = ids_RBS.reshape(-1, ids_RBS.shape[-1])
    ref_loss = ref(input_ids=all_ids, labels=all_ids).loss
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    results = run_distributed(_parallel_step, 4, hf_dir, ids_RBS, ranks_per_node=2)
    torch.testing.assert_close(sum(loss for loss, _, _ in results) / 4, ref_loss, rtol=0, atol=1e-5)
    for _, grads, experts in results:
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            expected = ref_grads[name]
            if name in experts:
                start, end = experts[name]
                expected = expected[start:end]
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
