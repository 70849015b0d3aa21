"""The shared ``parallelize`` on Qwen3.5-MoE: the plan at world 16 (fake backend, meta model), and its numbers on
gloo (2 nodes x 2 ranks, EP 2 x ep_fsdp 2) against transformers in one process on the global batch: the loss and
every gradient, on plain rows and on packed rows (the DeltaNet's state and convolution restart at each document)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import run_distributed
from moeshard.models.common import ParallelOptions, parallelize
from moeshard.models.common.testing import check_two_nodes_of_two, pack_documents
from moeshard.models.qwen35moe import Qwen35MoeForCausalLM, get_preset_config

# 4 rows of 20 tokens (one per rank): a document shorter than the convolution (3), documents across rows
PACKED_LENGTHS = (7, 30, 3, 15, 25)


@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_plan_at_world_16_experts_on_dim_1_both_mixers_in_their_layer():
    with fake_process_group(16, rank=13):
        meshes = build_meshes(ep_size=4, ranks_per_node=8, device_type="cpu")
        with torch.device("meta"):
            model = Qwen35MoeForCausalLM(get_preset_config("tiny"))  # 3 DeltaNet layers, then gated attention
        keys = list(model.state_dict())
        par = parallelize(model, meshes, ParallelOptions(activation_checkpointing="full"))
        assert list(model.state_dict()) == keys
        assert (par.ep_info.ep_size, par.ep_info.ep_rank) == (4, 1)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            if ".mlp.experts." in name:
                assert param.device_mesh.mesh_dim_names == ("ep_fsdp",) and param.placements == (Shard(1),), name
                assert param.shape[0] == 8 // 4 and param.to_local().shape[1] == param.shape[1] // 4, name
            else:  # both mixers, the gated shared expert, routers, norms: plain FSDP over all 16 ranks
                assert param.device_mesh.mesh_dim_names == ("fsdp",) and param.placements == (Shard(0),), name
        stages = [[fqn for fqn, _ in stage.modules] for stage in par.units.stages]
        assert stages == [
            ["model.embed_tokens"],
            *[[f"model.layers.{i}", f"model.layers.{i}.mlp.experts"] for i in range(4)],
            ["lm_head"],
        ]


@pytest.mark.parametrize(
    "options",
    [ParallelOptions(), ParallelOptions(activation_checkpointing="selective", expert_reshard_after_forward=False)],
    ids=["defaults", "selective-experts-kept"],
)
def test_two_nodes_of_two_at_ep_2_equal_transformers(hf_dir, load_reference, options):
    check_two_nodes_of_two(Qwen35MoeForCausalLM, hf_dir, load_reference(hf_dir), options, output_router_logits=False)


def _packed_step(path, rows):
    """One rank of 4 (EP 2 x ep_fsdp 2): its packed row forward and backward; its loss share and full gradients."""
    import torch.distributed as dist

    from moeshard.models.common import load_hf_config, load_hf_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = Qwen35MoeForCausalLM(load_hf_config(path, Qwen35MoeForCausalLM.hf_format))
    par = parallelize(model, meshes, ParallelOptions())
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    ids, labels, position_ids, document_ids = (x[rank : rank + 1] for x in rows)
    n_global = int((rows[1][:, 1:] != -100).sum())
    out = model(
        ids,
        labels=labels,
        position_ids=position_ids,
        document_ids=document_ids,
        num_items_in_batch=n_global / world,
        output_router_logits=False,
    )
    out.lm_loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    experts = {fqn: (m.expert_start, m.expert_end) for fqn, m in par.ep_info.params.items()}
    return out.lm_loss.detach(), grads, experts


def test_packed_rows_on_two_nodes_of_two_equal_transformers_per_document(hf_dir, load_reference):
    ids, labels, position_ids, document_ids, pieces = pack_documents(512, seq_len=20, lengths=PACKED_LENGTHS)
    assert ids.shape[0] == 4 and len(pieces) > 4
    reference = load_reference(hf_dir)
    ref_sum = torch.zeros(())
    for r, a, b in pieces:  # each document alone: what the packed rows must give
        piece = ids[r : r + 1, a:b]
        ref_sum = ref_sum + F.cross_entropy(reference(input_ids=piece).logits[0, :-1], piece[0, 1:], reduction="sum")
    ref_loss = ref_sum / int((labels[:, 1:] != -100).sum())
    ref_loss.backward()
    results = run_distributed(
        _packed_step, 4, hf_dir, (ids, labels, position_ids, document_ids), ranks_per_node=2, timeout=600
    )
    torch.testing.assert_close(sum(r[0] for r in results) / 4, ref_loss.detach(), rtol=0, atol=1e-5)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    for _, grads, experts in results:
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            expected = ref_grads[name]
            if name in experts:
                expected = expected[experts[name][0] : experts[name][1]]
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
