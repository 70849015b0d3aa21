"""apply_lora's frozen base in the compute dtype, and set_adapters' full tensors into a sharded layout."""

import pytest
import torch
import torch.nn as nn

from moeshard.lora import LoraOptions, apply_lora, reset_adapters, set_adapters


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 6, 3))
        self.down_proj = nn.Parameter(torch.randn(4, 3, 3))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(3, 5)
        self.experts = Experts()
        self.register_buffer("table", torch.ones(2))


OPTIONS = LoraOptions(rank=2, target_modules=("q_proj",), target_parameters=("experts.gate_up_proj",))


def test_base_dtype_holds_the_frozen_base_once_in_that_dtype_and_adapters_in_float32():
    model = Tiny()
    adapters = apply_lora(model, OPTIONS, base_dtype=torch.bfloat16)
    trained = {id(p) for p in adapters.parameters(model)}
    for name, p in model.named_parameters():
        if id(p) in trained:
            assert p.dtype == torch.float32 and p.requires_grad, name
        else:
            assert p.dtype == torch.bfloat16 and not p.requires_grad, name
    assert model.table.dtype == torch.float32  # buffers keep theirs
    out = model.q_proj(torch.randn(2, 3, dtype=torch.bfloat16))  # the hook casts the adapters to the input's dtype
    assert out.dtype == torch.bfloat16


def test_set_adapters_keeps_this_ep_rank_s_experts_of_full_tensors():
    full_model = Tiny()
    adapters = apply_lora(full_model, OPTIONS, seed=3)
    full = {k: v.clone() for k, v in adapters.state_dict(full_model).items()}
    full = {k: v + torch.arange(v.numel()).reshape(v.shape) for k, v in full.items()}  # B is zeros: make it distinct
    local = Tiny()
    local_adapters = apply_lora(local, OPTIONS, seed=0)
    for suffix in ("_lora_A", "_lora_B"):  # EP 2: this rank holds experts 2 and 3
        name = f"gate_up_proj{suffix}"
        setattr(local.experts, name, nn.Parameter(getattr(local.experts, name).detach()[2:].clone()))
    set_adapters(local, local_adapters, full, ep_rank=1)
    for name in adapters.names():
        want = full[name][2:] if "experts" in name else full[name]
        assert torch.equal(local.get_parameter(name), want), name
    with pytest.raises(ValueError, match="which EP rank 2 cannot hold"):
        set_adapters(local, local_adapters, full, ep_rank=2)
    with pytest.raises(ValueError, match="lack"):
        set_adapters(local, local_adapters, {})
    # reset_adapters is set_adapters of the seeded initial values
    reset_adapters(local, local_adapters, seed=3, ep_rank=1)
    fresh = Tiny()
    seeded = apply_lora(fresh, OPTIONS, seed=3).state_dict(fresh)
    assert torch.equal(local.get_parameter("q_proj.lora_A"), seeded["q_proj.lora_A"])
    assert torch.equal(local.get_parameter("experts.gate_up_proj_lora_A"), seeded["experts.gate_up_proj_lora_A"][2:])


def test_a_linear_module_that_refuses_adapters_is_one_line_and_its_model_is_untouched():
    class LossHead(nn.Linear):  # a linear whose forward is more than its GEMM says so
        lora_refusal = "its forward computes the loss from the weight"

    model = Tiny()
    model.head = LossHead(3, 7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for options in (
        LoraOptions(rank=2, target_modules=("q_proj", "head")),
        LoraOptions(rank=2, target_parameters=("head.weight",)),
    ):
        with pytest.raises(ValueError, match=r"^lora targets head \(LossHead\), which takes no adapter: its forward"):
            apply_lora(model, options)
    assert all(p.requires_grad for p in model.parameters())  # refused before anything was frozen or added
    assert {n for n, _ in model.named_parameters()} == set(before)
    assert apply_lora(model, LoraOptions(rank=2, target_modules=("q_proj",))).targets  # the others still adapt


def test_all_linear_leaves_out_the_output_layer_and_refusing_heads_and_needs_a_linear():
    class LossHead(nn.Linear):
        lora_refusal = "its forward computes the loss from the weight"

    class WithHead(Tiny):
        def __init__(self):
            super().__init__()
            self.k_proj, self.out, self.loss_head = nn.Linear(5, 5), nn.Linear(3, 9), LossHead(3, 7)

        def get_output_embeddings(self):  # transformers' name for the output layer, which PEFT leaves out
            return self.out

    adapters = apply_lora(WithHead(), LoraOptions(rank=2, target_modules="ALL-LINEAR"))
    assert [t.module for t in adapters.targets] == ["q_proj", "k_proj"]
    with pytest.raises(ValueError, match=r"^lora.target_modules 'all-linear': the model has no linear module that"):
        apply_lora(Experts(), LoraOptions(rank=2, target_modules="all-linear"))


def test_dropout_is_on_the_adapter_input_in_train_mode_only_and_refused_where_peft_has_none():
    torch.manual_seed(0)
    plain, dropped = Tiny(), Tiny()
    dropped.load_state_dict(plain.state_dict())
    kw = {"rank": 2, "alpha": 4, "target_modules": ("q_proj",)}
    a, b = apply_lora(plain, LoraOptions(**kw)), apply_lora(dropped, LoraOptions(**kw, dropout=0.5))
    with torch.no_grad():
        for m in (plain, dropped):
            m.q_proj.lora_B.copy_(torch.ones_like(m.q_proj.lora_B))
    x = torch.randn(64, 3)
    dropped.eval()  # evaluation: no dropout
    torch.testing.assert_close(dropped.q_proj(x), plain.q_proj(x))
    dropped.train()
    torch.manual_seed(5)
    y = dropped.q_proj(x)
    torch.manual_seed(5)
    x_d = torch.nn.functional.dropout(x, 0.5)  # the same draw: the base sees x, the adapter x with dropout
    q = dropped.q_proj
    torch.testing.assert_close(y, torch.nn.functional.linear(x, q.weight, q.bias) + 2.0 * x_d @ q.lora_A.T @ q.lora_B.T)
    assert not torch.allclose(y, plain.q_proj(x))
    assert a.options.dropout == 0 and b.options.dropout == 0.5
    # PEFT wraps fused experts (and linears named gate/up/down_proj, on MoE models) as parameters, with no dropout
    for options in (
        LoraOptions(rank=2, target_parameters=("experts.gate_up_proj",), dropout=0.1),
        LoraOptions(rank=2, target_modules=("q_proj", "down_proj"), dropout=0.1),
    ):
        model = Tiny()
        model.down_proj = nn.Linear(3, 3)
        with pytest.raises(ValueError, match=r"^lora.dropout 0.1 with \S+ targeted: PEFT applies no dropout to") as e:
            apply_lora(model, options)
        assert "\n" not in str(e.value) and all(p.requires_grad for p in model.parameters())
