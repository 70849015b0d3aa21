"""Presets, parameter counts, construction on meta, init, the parallel plan, and refused configs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from moeshard.ep import fqn_matches
from moeshard.models.qwen3moe import (
    Qwen3MoeForCausalLM,
    check_config,
    count_parameters,
    get_preset_config,
    is_moe_layer,
)


def test_qwen3_30b_a3b_on_meta():
    config = get_preset_config("qwen3-30b-a3b")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert total == 30_532_122_624  # 30.53 B
    assert count_parameters(config) == (total, 3_353_032_704)  # active per token ≈ 3.35 B
    experts = model.model.layers[47].mlp.experts
    assert experts.gate_up_proj.shape == (128, 1536, 2048)
    assert experts.down_proj.shape == (128, 2048, 768)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4096, 2048) and attn.k_proj.weight.shape == (512, 2048)
    assert model.model.layers[0].mlp.gate.weight.shape == (128, 2048)
    assert model.lm_head.weight.shape == (151936, 2048)
    assert (config.max_position_embeddings, config.rope_parameters["rope_theta"]) == (40960, 1e6)
    assert (config.norm_topk_prob, config.router_aux_loss_coef, config.tie_word_embeddings) == (True, 0.001, False)


def test_overrides_and_counts_with_dense_layers():
    config = get_preset_config("tiny", num_hidden_layers=3, mlp_only_layers=[1])
    assert [is_moe_layer(config, i) for i in range(3)] == [True, False, True]
    model = Qwen3MoeForCausalLM(config)
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    expert = 3 * 32 * 64
    assert total - active == 2 * (8 - 2) * expert
    sparse_step = get_preset_config("tiny", decoder_sparse_step=2)
    assert [is_moe_layer(sparse_step, i) for i in range(4)] == [False, True, False, True]
    with pytest.raises(ValueError, match=r"unknown Qwen3MoeConfig field\(s\) \['num_layers'\]"):
        get_preset_config("tiny", num_layers=2)
    with pytest.raises(ValueError, match="unknown Qwen3-MoE preset 'qwen3-235b'"):
        get_preset_config("qwen3-235b")


def test_meta_construction_then_init_weights():
    config = get_preset_config("tiny", pad_token_id=3, initializer_range=0.05)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name != "model.embed_tokens.weight":
            assert abs(p.std().item() - 0.05) < 0.01 and abs(p.mean().item()) < 0.01, name
    assert torch.equal(model.model.embed_tokens.weight[3], torch.zeros(64))
    loss = model(torch.randint(0, 512, (2, 8)), labels=torch.randint(0, 512, (2, 8))).loss
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5  # near-uniform predictions at init


def test_parallel_plan_matches_expert_params_only():
    model = Qwen3MoeForCausalLM(get_preset_config("tiny", mlp_only_layers=[0, 2]))
    plan = model.get_parallel_plan()
    assert plan.ep_plan == {
        "model.layers.*.mlp.experts.gate_up_proj": Shard(0),
        "model.layers.*.mlp.experts.down_proj": Shard(0),
    }
    assert plan.fsdp_units == ("model.embed_tokens", "model.layers.*", "lm_head")
    matched = sorted(n for n, _ in model.named_parameters() if any(fqn_matches(p, n) for p in plan.ep_plan))
    assert matched == [f"model.layers.{i}.mlp.experts.{w}" for i in (1, 3) for w in ("down_proj", "gate_up_proj")]
    modules = dict(model.named_modules())
    units = [n for n in modules if any(fqn_matches(p, n) for p in plan.fsdp_units)]
    assert units == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "lm_head"]


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=True is not supported"),
        (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type='yarn'"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, num_experts=8\]"),
    ],
)
def test_unsupported_configs_are_refused(override, message):
    config = get_preset_config("tiny")
    for key, value in override.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        check_config(config)
    with pytest.raises(ValueError, match=message):
        Qwen3MoeForCausalLM(config)


def test_other_architecture_config_is_refused():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="model_type 'llama', this model is 'qwen3_moe'"):
        Qwen3MoeForCausalLM(LlamaConfig())
