"""Presets (TorchTitan's 16B geometry, transformers' 671B defaults), counts against the built model, config checks."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from moeshard.models.deepseekv3 import (
    FAMILY,
    DeepseekV3ForCausalLM,
    count_parameters,
    flops_per_token,
    get_preset_config,
    is_moe_layer,
)
from moeshard.models.deepseekv3._layers import softmax_scale


def test_16b_is_torchtitans_flavor():
    c = get_preset_config("deepseek-v3-16b")
    geometry = (c.hidden_size, c.intermediate_size, c.moe_intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    assert geometry == (2048, 10944, 1408, 27, 16)
    assert (c.first_k_dense_replace, c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (1, 64, 2, 6)
    assert (c.scoring_func, c.q_lora_rank, c.kv_lora_rank, c.vocab_size) == ("softmax", None, 512, 102400)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.rope_parameters["rope_type"] == "yarn" and c.rope_parameters["factor"] == 40.0
    # TorchTitan: softmax_scale = (192)^-0.5 * (0.1 * 0.70 * ln 40 + 1)^2
    assert softmax_scale(c) == pytest.approx(192**-0.5 * (0.1 * 0.70 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    total, active = count_parameters(c)
    assert 15.5e9 < total < 16e9 and 2.5e9 < active < 2.8e9


def test_671b_is_transformers_defaults():
    c, ref = get_preset_config("deepseek-v3-671b"), DeepseekV3Config()
    for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "n_group", "topk_group", "q_lora_rank"):
        assert getattr(c, k) == getattr(ref, k), k
    assert [is_moe_layer(c, i) for i in range(4)] == [False, False, False, True]
    total, active = count_parameters(c)
    assert round(total / 1e9) == 671 and round(active / 1e9) == 38  # 37.6B: DeepSeek reports 37B activated


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_counts_equal_the_built_model(q_lora_rank):
    config = get_preset_config("tiny", q_lora_rank=q_lora_rank, attention_bias=True, n_shared_experts=2)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    total, active = count_parameters(config)
    stored = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert total == stored
    assert total - active == 2 * (8 - 2) * 3 * 32 * 64  # 2 MoE layers, 6 experts a token does not use


def test_flops_count_mla_from_its_projections():
    c = get_preset_config("tiny", q_lora_rank=None, num_hidden_layers=1, first_k_dense_replace=1)
    d, h = 64, 4
    matmul = d * 512 + d * h * 24 + d * (16 + 8) + 16 * h * (16 + 16) + h * 16 * d + 3 * d * 128
    assert flops_per_token(c, 100) == 6 * matmul + 6 * 50 * h * (24 + 16)
    assert FAMILY.flops_per_token(c, 100) == flops_per_token(c, 100) and FAMILY.model_class is DeepseekV3ForCausalLM


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(scoring_func="sqrtsoftplus"), "scoring_func"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "rope_type='dynamic'"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2"),
        (dict(n_group=3), "n_group=3"),
        (dict(topk_group=5), "topk_group=5"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
        (dict(num_layers=2), r"unknown DeepseekV3Config field\(s\) \['num_layers'\]"),
    ],
)
def test_bad_configs_are_refused_by_name(overrides, match):
    with pytest.raises(ValueError, match=match):
        get_preset_config("tiny", **overrides)
    with pytest.raises(ValueError, match="unknown DeepSeek-V3 preset 'v4'"):
        get_preset_config("v4")
