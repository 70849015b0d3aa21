"""LoRA targets on every family's tiny model: each family's attention (or sequence mixer) projections, its shared
experts' linears where it has them and its fused expert tensors resolve, the adapted model equals its base with
the adapters merged, and a name the model lacks is one line. CPU, one process, float32."""

from __future__ import annotations

import copy

import pytest
import torch

from moeshard.lora import LoraOptions, apply_lora, merged_weights

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _tiny(family: str):
    if family == "deepseek_v3":
        from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM as cls
        from moeshard.models.deepseekv3 import get_preset_config
    elif family == "qwen3_5_moe_text":
        from moeshard.models.qwen35moe import Qwen35MoeForCausalLM as cls
        from moeshard.models.qwen35moe import get_preset_config
    else:
        from moeshard.models.gptoss import GptOssForCausalLM as cls
        from moeshard.models.gptoss import get_preset_config
    torch.manual_seed(0)
    model = cls(get_preset_config("tiny"))
    with torch.no_grad():  # every parameter random (biases included), so each target moves the output
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model


# family -> target_modules
TARGETS = {
    # MLA's projections on every layer; the shared experts' linears on the MoE layers
    "deepseek_v3": ("q_a_proj", "kv_b_proj", "o_proj", "shared_experts.gate_proj", "shared_experts.down_proj"),
    # the gated-attention layers' projections, the Gated DeltaNet layers' in/out projections, the shared expert
    "qwen3_5_moe_text": ("q_proj", "o_proj", "in_proj_qkv", "out_proj", "shared_expert.up_proj"),
    # attention with sinks: projections with biases
    "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@pytest.mark.parametrize("named", [True, False], ids=["named", "all-linear"])
@pytest.mark.parametrize("family", sorted(TARGETS))
def test_targets_resolve_and_the_adapted_model_equals_the_merged_base(family, named):
    # all-linear: every linear module of the family (its mixers', shared experts', gates'), each through its hook
    base = _tiny(family)
    modules = TARGETS[family] if named else "all-linear"
    options = LoraOptions(rank=4, alpha=8, target_modules=modules, target_parameters=EXPERTS)
    adapted = copy.deepcopy(base)
    adapters = apply_lora(adapted, options, seed=1)
    if named:
        want_linear = {n for n, _ in base.named_modules() if any(n == t or n.endswith("." + t) for t in modules)}
        assert all(any(n.endswith("." + t) for n in want_linear) for t in modules)  # every entry hits something
    else:
        want_linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert {t.module for t in adapters.targets if t.kind == "linear"} == want_linear
    assert {t.base_name for t in adapters.targets if t.kind == "experts"} == {
        n for n, _ in base.named_parameters() if n.endswith(EXPERTS)
    }
    with torch.no_grad():  # B starts at zero (the adapted model equals its base): give it values
        for name, p in adapted.named_parameters():
            if "_lora_B" in name or name.endswith("lora_B"):
                p.copy_(torch.randn_like(p) * 0.2)
    base.load_state_dict(merged_weights(adapters, base.state_dict(), adapters.state_dict(adapted)), strict=False)
    ids = torch.randint(0, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    out = adapted(ids, labels=ids)
    with torch.no_grad():
        want = base(ids).logits
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    trained = {n for n, p in adapted.named_parameters() if p.grad is not None}
    assert trained == set(adapters.names())  # the base gets no gradient
    assert all(adapted.get_parameter(n).grad.abs().sum() > 0 for n in adapters.names() if n.endswith("lora_A"))


@pytest.mark.parametrize(
    ("family", "entry"),
    [("gpt_oss", "q_a_proj"), ("qwen3_5_moe_text", "kv_b_proj"), ("deepseek_v3", "in_proj_qkv")],
)
def test_another_familys_module_name_is_one_line(family, entry):
    with pytest.raises(ValueError, match=f"lora.target_modules entry '{entry}' matches no module") as err:
        apply_lora(_tiny(family), LoraOptions(rank=4, target_modules=(entry,), target_parameters=EXPERTS))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("where", ["target_modules", "target_parameters"])
def test_the_lm_head_is_refused_in_one_line(family, where):
    # the head computes the training loss from its weight in chunks: a hook's term would silently be left out
    entry = "lm_head" if where == "target_modules" else "lm_head.weight"
    with pytest.raises(ValueError, match=r"lora targets lm_head \(LMHead\), which takes no adapter: ") as err:
        apply_lora(_tiny(family), LoraOptions(rank=4, **{where: (entry,)}))
    assert "\n" not in str(err.value)
