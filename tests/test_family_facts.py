"""Each preset's facts, derived from its model (``ModelFamily.facts``), against the numbers the families' hand-written
formulas gave before they were removed, so a change in the derivation shows.

The expected numbers are the old functions' output (``count_parameters``, ``flops_per_token(config, 4096)``,
``activations_per_token``, ``kept_attention_per_token`` of ``moeshard.models.{qwen3moe,deepseekv3}`` at commit
73640a1), printed by::

    for name in PRESETS: c = get_preset_config(name); print(name, count_parameters(c), flops_per_token(c, 4096),
                                                      activations_per_token(c), kept_attention_per_token(c))

Activations differ where the hand formulas disagreed with each other (the derivation counts one rule for both):
Qwen3-MoE's left out its q/k norms' outputs (H·Dh + G·Dh) and its rotated keys (G·Dh), which DeepSeek-V3's counted
for its latent norms and its keys; DeepSeek-V3's counted its key/value latent norm as ``kv_lora_rank +
qk_rope_head_dim`` wide, where it normalises ``kv_lora_rank`` only.
"""

from __future__ import annotations

import pytest

from moeshard.models import deepseekv3, qwen3moe

# preset: (total, active), FLOPs per token at 4096, (attention, other MLP) activations, kept attention
HAND_WRITTEN = {
    (qwen3moe, "qwen3-30b-a3b"): ((30532122624, 3353032704), 23081779200.0, (13312, 0), (6144, 32)),
    (qwen3moe, "tiny"): ((314048, 166592), 7090176.0, (256, 0), (128, 4)),
    (deepseekv3, "deepseek-v3-671b"): ((671026419200, 37552297472), 250449887232.0, (127104, 6144), (7168, 0)),
    (deepseekv3, "deepseek-v3-16b"): ((15706485888, 2661151872), 16406544384.0, (16512, 8448), (2048, 0)),
    (deepseekv3, "tiny"): ((240736, 167008), 6700032.0, (592, 96), (64, 0)),
}


def _fixed_attention(family, config) -> int:
    """What the derivation adds to the hand formula's attention activations (see the module docstring)."""
    if family is qwen3moe:
        hd = config.head_dim
        return config.num_attention_heads * hd + 2 * config.num_key_value_heads * hd
    return -config.qk_rope_head_dim


@pytest.mark.parametrize("family, preset", list(HAND_WRITTEN), ids=lambda v: getattr(v, "__name__", v))
def test_derived_facts_equal_the_hand_written_ones(family, preset):
    params, flops, (attention, mlp), kept = HAND_WRITTEN[(family, preset)]
    config = family.get_preset_config(preset)
    facts = family.FAMILY.facts(config)
    assert (facts.parameters, facts.active_parameters) == params == family.count_parameters(config)
    assert facts.flops_per_token(4096) == flops == family.FAMILY.flops_per_token(config, 4096)
    assert (facts.attention_activations, facts.mlp_activations) == (attention + _fixed_attention(family, config), mlp)
    assert facts.kept_attention == kept


def test_the_30b_facts_the_app_reads():
    facts = qwen3moe.FAMILY.facts(qwen3moe.get_preset_config("qwen3-30b-a3b"))
    assert (facts.attention_activations, facts.attention_heads) == (18432, 32)  # 4·H·Dh + 4·G·Dh = 16384 + 2048
    assert (facts.layers, facts.moe_layers, facts.num_experts, facts.top_k, facts.expert_width) == (48, 48, 128, 8, 768)
    v3 = deepseekv3.FAMILY.facts(deepseekv3.get_preset_config("deepseek-v3-671b"))
    assert (v3.layers, v3.moe_layers, v3.num_experts, v3.top_k, v3.expert_width) == (61, 58, 256, 8, 2048)


def test_the_235b_preset_facts():
    """Qwen3-235B-A22B (the Hub's config.json): its parameters derived from the model, as printed by::

        python -c "from moeshard.models import qwen3moe; c = qwen3moe.get_preset_config('qwen3-235b-a22b');
                   f = qwen3moe.FAMILY.facts(c); print(f.parameters, f.active_parameters)"

    (the model card's 235B in total, 22B activated)."""
    config = qwen3moe.get_preset_config("qwen3-235b-a22b")
    facts = qwen3moe.FAMILY.facts(config)
    assert (facts.parameters, facts.active_parameters) == (235093634560, 22190763520)
    assert (facts.parameters, facts.active_parameters) == qwen3moe.count_parameters(config)
    shape = (facts.layers, facts.moe_layers, facts.num_experts, facts.top_k, facts.expert_width)
    assert shape == (94, 94, 128, 8, 1536)
    assert (facts.hidden_size, facts.attention_heads) == (4096, 64)
