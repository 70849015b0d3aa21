"""Sequence parallelism inside the full layout against transformers: 4 gloo ranks run ``parallelize`` with
``sp_size`` (EP, FSDP2 over every rank, attention on head shards between two all-to-alls) on packed rows of several
documents; transformers' ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` runs each document alone in one process.
The mean LM loss over every target of the global batch and every gradient (gathered, experts unsharded) agree within
float32 tolerance, at sp 2 x ep 2 (two data-parallel groups, two nodes of two) and at sp 4 (one group; Qwen3-MoE's 2
key/value heads replicated over 4 shards, MLA's 4 heads one per shard)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeshard.meshes.testing import run_distributed
from moeshard.models.common.testing import pack_documents

SEQ = 24  # divisible by sp 4; pack_documents cuts 2 rows of several documents each, one across the rows

# 2 layers (one MoE, one dense), 8 experts top-2, 4 query heads: the families' tiny shapes, as transformers names them
_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    pad_token_id=0,
)
_CONFIGS = {  # each family's keys for the same shapes, over _TINY
    "qwen3moe": dict(
        _TINY,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        mlp_only_layers=[1],
        rope_theta=1e6,
        max_position_embeddings=128,
    ),
    "deepseekv3": dict(
        _TINY,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_mtp_layers=0,
    ),
}


def _classes(family: str):
    """``(transformers' class, its config class, ours)`` of ``family``."""
    if family == "qwen3moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from moeshard.models.qwen3moe import Qwen3MoeForCausalLM as Ours

        return Qwen3MoeForCausalLM, Qwen3MoeConfig(**_CONFIGS[family]), Ours
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM as Ours

    return DeepseekV3ForCausalLM, DeepseekV3Config(**_CONFIGS[family]), Ours


def _save(family: str, path):
    hf_class, config, _ = _classes(family)
    torch.manual_seed(1234)
    model = hf_class(config)
    with torch.no_grad():  # DeepSeek-V3's routing bias, away from zero so that it shapes the selection
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(path)


def _rows():
    return pack_documents(512, seq_len=SEQ)


def _transformers_per_document(family: str, path):
    """transformers' model on each document alone: the mean over every target of the rows, and its gradients."""
    hf_class, _, _ = _classes(family)
    model = hf_class.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    ids, labels, _, _, pieces = _rows()
    assert len(pieces) > ids.shape[0]  # several documents per row
    n = int((labels[:, 1:] != -100).sum())
    total = torch.zeros(())
    for r, a, b in pieces:
        piece = ids[r : r + 1, a:b]
        logits = model(input_ids=piece).logits
        total = total + F.cross_entropy(logits[0, :-1], piece[0, 1:], reduction="sum")
    loss = total / n
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _parallel(family: str, path, sp: int, ep: int):
    import torch.distributed as dist

    from moeshard.data import Batch
    from moeshard.fsdp_moe import num_items_for_global_mean
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, load_hf_config, load_hf_weights, model_inputs, parallelize

    _, _, ours = _classes(family)
    meshes = build_meshes(ep_size=ep, device_type="cpu", sp_size=sp)
    with torch.device("meta"):
        model = ours(load_hf_config(path, ours.hf_format))
    par = parallelize(model, meshes, ParallelOptions(sp_size=sp))
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    ids, labels, position_ids, document_ids, _ = _rows()
    per = ids.shape[0] // meshes.dp_size  # the data-parallel group's rows; each rank of it takes its shard
    sl = slice(meshes.dp_rank * per, (meshes.dp_rank + 1) * per)
    cu = torch.zeros(1, dtype=torch.int32)  # varlen segments: unused on CPU
    batch = Batch(ids[sl], labels[sl], position_ids[sl], document_ids[sl], cu, SEQ, None, (0,) * per, (0,) * per)
    inputs = model_inputs(batch, sp_rank=meshes.sp_rank, sp_size=sp)
    out = model(**inputs.kwargs, num_items_in_batch=num_items_for_global_mean(inputs.num_targets), return_logits=False)
    out.lm_loss.backward()
    loss = out.lm_loss.detach() / dist.get_world_size()
    dist.all_reduce(loss)  # FSDP's mean over the ranks, as the gradients
    grads = full_tensors(model, grads=True)
    return float(loss), {k: v.clone() for k, v in grads.items()}, inputs.num_targets


@pytest.fixture(scope="module", params=["qwen3moe", "deepseekv3"])
def family_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"sp_hf_{request.param}")
    _save(request.param, path)
    return request.param, path


@pytest.mark.parametrize(
    ("sp", "ep", "per_node"), [(2, 2, 2), (4, 2, 4)], ids=["sp2xep2-two-nodes", "sp4-more-shards-than-kv-heads"]
)
def test_sp_with_ep_equals_transformers_per_document(family_dir, sp, ep, per_node):
    family, path = family_dir
    loss, grads = _transformers_per_document(family, path)
    res = run_distributed(_parallel, 4, family, path, sp, ep, ranks_per_node=per_node, timeout=300)
    labels = _rows()[1]
    assert sum(n for _, _, n in res) == int((labels[:, 1:] != -100).sum())  # every target counted once
    for got, got_grads, _ in res:
        assert got == pytest.approx(loss, rel=1e-5)
        # every parameter of ours has its transformers gradient (an expert no token reached: none there, zero here)
        for name, g in got_grads.items():
            want = grads.get(name, torch.zeros_like(g))
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert grads.keys() <= got_grads.keys()
