"""Facts derived from any family's model: a toy family whose config names nothing as the Hub families do, and whose
attention has different q·k and value head sizes, gets its counts without writing a formula."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from moeshard.models.common import (
    DecoderModel,
    DenseMLP,
    Experts,
    HFFormat,
    ModelFamily,
    MoEBlock,
    MoECausalLM,
    TopKRouter,
)
from moeshard.models.common._facts import model_facts

V, D, L, H, DQK, DV, E, K, FW, SHARED, DENSE = 96, 32, 3, 4, 12, 8, 6, 2, 16, 24, 40


class ToyConfig(PretrainedConfig):
    """Field names of no Hub family: ``pool``, ``picks``, ``cell`` for the experts."""

    model_type = "toy_moe"

    def __init__(self, **kw):
        kw.setdefault("vocab_size", V)
        kw.setdefault("hidden_size", D)
        kw.setdefault("num_hidden_layers", L)
        kw.setdefault("num_attention_heads", H)
        kw.setdefault("intermediate_size", DENSE)
        kw.setdefault("rms_norm_eps", 1e-6)
        kw.setdefault("head_dim", DQK)
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1e4})
        kw.setdefault("pool", E)
        kw.setdefault("picks", K)
        kw.setdefault("cell", FW)
        kw.setdefault("initializer_range", 0.02)
        kw.setdefault("output_router_logits", False)
        kw.setdefault("pad_token_id", None)
        super().__init__(**kw)


class ToyAttention(nn.Module):
    """Multi-head attention whose values are narrower than its queries and keys (no RoPE: the toy needs none)."""

    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.qk_head_dim, self.v_head_dim = config.head_dim, DV
        self.qk = nn.Linear(config.hidden_size, 2 * H * DQK, bias=False)
        self.v = nn.Linear(config.hidden_size, H * DV, bias=False)
        self.out = nn.Linear(H * DV, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, H, DQK).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, s, H, DV).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, H * DV))


class ToyBlock(MoEBlock):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__(
            Experts(config.pool, config.hidden_size, config.cell),
            TopKRouter(config.pool, config.hidden_size, config.picks, True),
            DenseMLP(config.hidden_size, SHARED),
        )


class ToyModel(DecoderModel):
    attention_class = ToyAttention
    moe_block_class = ToyBlock
    is_moe_layer = staticmethod(lambda config, i: i > 0)  # a dense first layer


class ToyForCausalLM(MoECausalLM):
    base_model_class = ToyModel
    hf_format = HFFormat(
        model_type="toy_moe",
        architecture="ToyForCausalLM",
        config_class=ToyConfig,
        check_config=lambda config: None,
        structural_keys=("pool", "cell"),
        num_experts=lambda config: config.pool,
    )


TOY = ModelFamily(ToyForCausalLM, {"toy": {}}, lambda name, **kw: ToyConfig(**kw))


def test_a_toy_family_gets_its_facts_without_a_formula():
    config = TOY.preset_config("toy")
    facts = TOY.facts(config)
    model = ToyForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * D * FW
    assert (facts.parameters, TOY.count_parameters(config)) == (total, (total, total - 2 * (E - K) * expert))
    assert (facts.layers, facts.moe_layers, facts.hidden_size) == (L, 2, D)
    assert (facts.num_experts, facts.top_k, facts.expert_width, facts.attention_heads) == (E, K, FW, H)
    attention = D * 2 * H * DQK + D * H * DV + H * DV * D
    mlps = 2 * (K * expert + E * D + 3 * D * SHARED) + 3 * D * DENSE  # two MoE layers (router, shared), one dense
    assert facts.matmul_parameters == V * D + L * attention + mlps  # the head; the embedding lookup is no matmul
    assert facts.attention_width == L * H * (DQK + DV)
    assert TOY.flops_per_token(config, 10) == 6 * facts.matmul_parameters + 6 * 5 * L * H * (DQK + DV)
    # qk (2·H·DQK) and v (H·DV) kept, the out projection's input (H·DV), the q and k the kernel reads (2·H·DQK)
    assert facts.attention_activations == 2 * H * DQK + H * DV + H * DV + 2 * H * DQK
    assert facts.mlp_activations == 3 * SHARED  # the shared experts' gate, up and activation
    assert facts.kept_attention == (D, 0)  # q·k and value head sizes differ: the attention is recomputed


def test_facts_follow_the_model_not_the_field_names():
    small, wide = TOY.facts(ToyConfig(cell=4, picks=1)), TOY.facts(ToyConfig(cell=64, picks=3))
    assert (small.expert_width, small.top_k, wide.expert_width, wide.top_k) == (4, 1, 64, 3)
    assert wide.active_parameters - small.active_parameters == 2 * (3 * 3 * D * 64 - 1 * 3 * D * 4)
    dense = TOY.facts(ToyConfig(num_hidden_layers=1))  # layer 0 is dense: no MoE layer at all
    assert (dense.moe_layers, dense.num_experts, dense.top_k, dense.expert_width, dense.mlp_activations) == (0,) * 5


def test_an_attention_that_declares_nothing_is_named():
    class Bare(ToyAttention):
        def __init__(self, config):
            super().__init__(config)
            del self.qk_head_dim, self.v_head_dim

    class BareModel(ToyModel):
        attention_class = Bare

    class BareLM(ToyForCausalLM):
        base_model_class = BareModel

    with pytest.raises(ValueError, match="Bare does not declare qk_head_dim, v_head_dim: set them"):
        model_facts(BareLM, ToyConfig())


def test_the_shared_toy_family_gets_its_facts_and_refuses_an_unknown_preset():
    from moeshard.models.common.testing import TOY_FAMILY, ToyForCausalLM

    config = TOY_FAMILY.preset_config("toy", cell=16)
    facts, model = TOY_FAMILY.facts(config), ToyForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert (facts.parameters, facts.active_parameters) == (total, total - 2 * (8 - 2) * 3 * 64 * 16)
    assert (facts.layers, facts.moe_layers, facts.num_experts, facts.top_k, facts.expert_width) == (3, 2, 8, 2, 16)
    assert TOY_FAMILY.name == "toy_moe" and TOY_FAMILY.preset_config("toy-4").num_hidden_layers == 4
    with pytest.raises(ValueError, match="unknown toy preset 'big'"):
        TOY_FAMILY.preset_config("big")


def test_a_window_layer_counts_the_keys_it_sees():
    class Windowed(ToyAttention):  # the layer spec any family can declare: a query sees at most 4 keys
        def __init__(self, config):
            super().__init__(config)
            self.attention_window = 4

    class WindowedModel(ToyModel):
        attention_class = Windowed

    class WindowedLM(ToyForCausalLM):
        base_model_class = WindowedModel

    config = ToyConfig()
    full, windowed = model_facts(ToyForCausalLM, config), model_facts(WindowedLM, config)
    width = H * (DQK + DV)
    assert windowed.attention_width == 0 and windowed.windowed_attention == ((4, width),) * L
    for s in (2, 4):  # up to the window: the causal mean, S/2, as a full layer
        assert windowed.flops_per_token(s) == full.flops_per_token(s)
    # beyond: the mean of min(position, 4) over 100 positions, 4 - 16/200, not 100/2
    assert windowed.flops_per_token(100) == 6 * windowed.matmul_parameters + 6 * (4 - 16 / 200) * L * width
    assert full.flops_per_token(100) - windowed.flops_per_token(100) == pytest.approx(6 * (50 - 3.92) * L * width)

    class Broken(ToyAttention):
        attention_window = 0

    class BrokenModel(ToyModel):
        attention_class = Broken

    class BrokenLM(ToyForCausalLM):
        base_model_class = BrokenModel

    with pytest.raises(ValueError, match="Broken.attention_window=0: declare a positive int"):
        model_facts(BrokenLM, config)


def test_layers_of_two_kinds_each_count_theirs_and_an_equal_config_reuses_its_facts():
    class Narrow(ToyAttention):  # odd layers: values half as wide (the same class, other shapes)
        def __init__(self, config, width):
            super().__init__(config)
            self.v_head_dim = width
            self.v = nn.Linear(config.hidden_size, H * width, bias=False)
            self.out = nn.Linear(H * width, config.hidden_size, bias=False)

        def forward(self, x, cos, sin, mask):
            b, s, _ = x.shape
            q, k = self.qk(x).view(b, s, 2, H, DQK).permute(2, 0, 3, 1, 4)
            v = self.v(x).view(b, s, H, self.v_head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(o.transpose(1, 2).reshape(b, s, H * self.v_head_dim))

    class MixedModel(ToyModel):
        @classmethod
        def build_mixer(cls, config, layer_idx):
            return "self_attn", Narrow(config, DV if layer_idx % 2 == 0 else DV // 2)

    class MixedLM(ToyForCausalLM):
        base_model_class = MixedModel

    config = ToyConfig()
    facts, full = model_facts(MixedLM, config), model_facts(ToyForCausalLM, config)
    per_layer = [2 * H * DQK + 2 * H * w + 2 * H * DQK for w in (DV, DV // 2, DV)]  # as the first test counts one
    assert facts.mixer_activations == sum(per_layer) and full.mixer_activations == L * per_layer[0]
    assert facts.attention_width == 2 * H * (DQK + DV) + H * (DQK + DV // 2)
    # An equal config (another object) gets the facts already derived; a changed one its own.
    assert model_facts(MixedLM, ToyConfig()) is facts
    assert model_facts(MixedLM, ToyConfig(num_hidden_layers=2)).mixer_activations == sum(per_layer[:2])
    # A config holding a value JSON cannot (a set) is derived each time, not refused.
    odd = ToyConfig()
    odd.tags = {"a", "b"}
    assert model_facts(MixedLM, odd) == facts and model_facts(MixedLM, odd) is not facts
