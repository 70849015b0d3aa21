"""Against PEFT on tiny transformers Qwen3-MoE and DeepSeek-V3 (float32, CPU): logits, gradients, the folder both
ways, merging.

The adapted model here is the transformers model itself with :func:`apply_lora`'s adapters; its experts run a
grouped forward (token copies sorted by expert, the adapters through :func:`expert_lora_delta`) in place of the
transformers loop, which is what a model with grouped GEMMs does with them.
"""

import copy
import json
import types

import pytest
import torch

from moeshard.lora import LoraOptions, apply_lora, expert_lora_delta, load_adapter, merged_weights, save_adapter
from moeshard.lora._peft import read_adapter_options

peft = pytest.importorskip("peft", reason="the parity tests need the `test` extra (peft)")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

MODULES = ("q_proj", "o_proj")
PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# The dense layer's and the shared expert's MLP: names PEFT on transformers 5 would retarget onto the fused experts
# were they written to the folder's target_modules (see README, "PEFT's reading").
MLP = ("gate_proj", "up_proj", "down_proj")
# DeepSeek-V3: MLA's projections and both MLPs.
DSV3_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *MLP)
EXPERT_CLASSES = ("Qwen3MoeExperts", "DeepseekV3Experts")


def _tiny_base(dense_layers=()):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=list(dense_layers), norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float().eval()


def _tiny_deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=64, num_mtp_layers=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # transformers initialises the router to zeros: ties would make routing arbitrary
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def _grouped_experts_forward(adapters, model, name):
    """The experts of module ``name`` computed on rows grouped by expert, each adapter in its grouped form."""

    def forward(self, hidden_TD, ids_TK, weights_TK):
        T, K = ids_TK.shape
        order = ids_TK.reshape(-1).argsort(stable=True)
        expert_N, token_N = ids_TK.reshape(-1)[order], order // K
        counts = torch.bincount(expert_N, minlength=self.num_experts)
        x_ND = hidden_TD[token_N]

        def project(x, param):  # the base per row (a test's reference), the adapter grouped
            y = torch.einsum("ni,noi->no", x, getattr(self, param)[expert_N])
            ad = adapters.expert(model, name, param)
            return y if ad is None else y + expert_lora_delta(x, counts, ad.lora_A, ad.lora_B, ad.scaling)

        gate, up = project(x_ND, "gate_up_proj").chunk(2, dim=-1)
        y_ND = project(self.act_fn(gate) * up, "down_proj") * weights_TK.reshape(-1)[order, None]
        return torch.zeros_like(hidden_TD).index_add_(0, token_N, y_ND.to(hidden_TD.dtype))

    return forward


def _ours(base, options, seed=1, random_b=True):
    model = copy.deepcopy(base)
    adapters = apply_lora(model, options, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for t in adapters.targets:
            if random_b:  # B starts at zero; a parity test wants the adapters to matter
                b = model.get_parameter(t.b_name)
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    for name, module in model.named_modules():
        if type(module).__name__ in EXPERT_CLASSES:
            module.forward = types.MethodType(_grouped_experts_forward(adapters, model, name), module)
    return model, adapters


def _batch():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    return ids


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.fixture(scope="module")
def base():
    return _tiny_base()


@pytest.mark.parametrize("family", ["qwen3moe", "qwen3moe-dense-mlp", "deepseekv3"])
def test_save_then_peft_loads_our_adapter_with_equal_logits_and_gradients(base, family, tmp_path):
    modules = {"qwen3moe": MODULES, "qwen3moe-dense-mlp": (*MODULES, *MLP), "deepseekv3": DSV3_MODULES}[family]
    if family == "deepseekv3":
        base = _tiny_deepseek_v3()
    elif family == "qwen3moe-dense-mlp":  # layer 0 a dense MLP: its gate/up/down_proj are plain linears
        base = _tiny_base(dense_layers=[0])
    options = LoraOptions(rank=4, alpha=8, target_modules=modules, target_parameters=PARAMS)
    ours, adapters = _ours(base, options)
    if family != "qwen3moe":
        assert sum(t.module.endswith(MLP) for t in adapters.targets) == {"deepseekv3": 6}.get(family, 3)
    assert all(not p.requires_grad for n, p in ours.named_parameters() if "lora" not in n)
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == sorted(adapters.names())
    save_adapter(tmp_path, adapters, adapters.state_dict(ours), base_model="tiny/qwen3-moe")
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path), is_trainable=True)
    ids = _batch()
    with torch.no_grad():
        ref = base(input_ids=ids).logits
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert (a - ref).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    _loss(ours, ids).backward()
    _loss(theirs, ids).backward()
    save_adapter(tmp_path / "grads", adapters, {n: p.grad for n, p in ours.named_parameters() if p.requires_grad})
    ours_grads = load_file(str(tmp_path / "grads/adapter_model.safetensors"))  # PEFT's names and layout
    their_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert sorted(ours_grads) == sorted(their_grads)
    assert any("experts.base_layer.lora_A" in n for n in their_grads)  # both expert tensors, nested
    for n in ours_grads:
        torch.testing.assert_close(ours_grads[n], their_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_peft_save_then_our_load(base, tmp_path):
    config = peft.LoraConfig(
        r=4, lora_alpha=16, use_rslora=True, target_modules=list(MODULES), target_parameters=list(PARAMS),
        init_lora_weights=False,  # random B too
    )  # fmt: skip
    torch.manual_seed(5)
    theirs = peft.get_peft_model(copy.deepcopy(base), config)
    theirs.save_pretrained(str(tmp_path))
    options = read_adapter_options(tmp_path)
    assert options == LoraOptions(4, 16, True, tuple(sorted(MODULES)), tuple(sorted(PARAMS)), str(tmp_path))
    ours, adapters = _ours(base, options, random_b=False)
    adapters.load_state_dict(ours, load_adapter(tmp_path, adapters))
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_merged_weights_equal_peft_merge(base, tmp_path):
    options = LoraOptions(rank=2, alpha=3, target_modules=("o_proj",), target_parameters=("mlp.experts.down_proj",))
    ours, adapters = _ours(base, options)
    save_adapter(tmp_path, adapters, adapters.state_dict(ours))
    merged = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).merge_and_unload().state_dict()
    mine = merged_weights(adapters, ours.state_dict(), adapters.state_dict(ours))
    assert sorted(mine) == sorted(t.base_name for t in adapters.targets)
    for name, w in mine.items():
        torch.testing.assert_close(w, merged[name], rtol=1e-6, atol=1e-6, msg=name)
        assert not torch.equal(w, base.state_dict()[name])


def test_one_expert_tensor_alone_has_no_base_layer_in_its_names(base, tmp_path):
    options = LoraOptions(rank=2, alpha=2, target_parameters=("mlp.experts.gate_up_proj",))
    ours, adapters = _ours(base, options)
    save_adapter(tmp_path, adapters, adapters.state_dict(ours))
    names = sorted(load_file(str(tmp_path / "adapter_model.safetensors")))
    assert names[0] == "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_init_is_peft_s_and_seeded(base):
    options = LoraOptions(rank=4, alpha=8, target_modules=("q_proj",), target_parameters=("mlp.experts.down_proj",))
    m1, a1 = _ours(base, options, seed=7, random_b=False)
    m2, _ = _ours(base, options, seed=7, random_b=False)
    for t in a1.targets:
        A, B = m1.get_parameter(t.a_name), m1.get_parameter(t.b_name)
        assert torch.equal(A, m2.get_parameter(t.a_name)) and not B.any()
        assert A.dtype == torch.float32
        bound = 1 / A.shape[-1] ** 0.5  # kaiming-uniform, a = sqrt(5), fan_in = in
        assert A.abs().max() <= bound and A.abs().max() > 0.8 * bound
    ids = _batch()
    with torch.no_grad():  # B = 0: the adapted model starts as the base
        torch.testing.assert_close(m1(input_ids=ids).logits, base(input_ids=ids).logits)


def test_bad_targets_and_adapters_are_one_line_errors(base, tmp_path):
    def fails(fn, message):
        with pytest.raises(ValueError, match=message) as e:
            fn()
        assert "\n" not in str(e.value)

    model = copy.deepcopy(base)
    fails(lambda: apply_lora(model, LoraOptions(rank=2, target_modules=("qkv_proj",))), "entry 'qkv_proj' matches no")
    fails(lambda: apply_lora(model, LoraOptions(rank=2, target_modules=("mlp",))), r"matches model.layers.0.mlp \(")
    fails(
        lambda: apply_lora(model, LoraOptions(rank=2, target_parameters=("experts.up_proj",))),
        "entry 'experts.up_proj' matches no parameter",
    )
    fails(
        lambda: apply_lora(model, LoraOptions(rank=2, target_parameters=("input_layernorm.weight",))),
        "neither a fused 3-D expert tensor",
    )
    fails(
        lambda: apply_lora(
            model, LoraOptions(rank=2, target_modules=("q_proj",), target_parameters=("q_proj.weight",))
        ),
        "targets model.layers.0.self_attn.q_proj twice",
    )
    options = LoraOptions(rank=2, alpha=4, target_modules=MODULES, target_parameters=PARAMS)
    ours, adapters = _ours(base, options)
    fails(lambda: load_adapter(tmp_path / "none", adapters), "is not a PEFT adapter folder")
    save_adapter(tmp_path, adapters, adapters.state_dict(ours), base_model="Qwen/Qwen3-30B-A3B")
    assert load_adapter(tmp_path, adapters, base_model="/models/Qwen3-30B-A3B")  # a local copy of the same model
    fails(lambda: load_adapter(tmp_path, adapters, base_model="Qwen/Qwen3-235B-A22B"), "trained on Qwen/Qwen3-30B")
    for other, message in [
        (LoraOptions(rank=4, alpha=4, target_modules=MODULES, target_parameters=PARAMS), "has rank=2, this job rank=4"),
        (
            LoraOptions(rank=2, alpha=4, target_modules=("q_proj",), target_parameters=PARAMS),
            "use the adapter's targets",
        ),
        (LoraOptions(rank=2, alpha=4, target_modules=MODULES), "use the adapter's targets"),
    ]:
        _, other_adapters = _ours(base, other)
        fails(lambda a=other_adapters: load_adapter(tmp_path, a), message)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    fails(lambda: load_adapter(tmp_path, adapters), "uses PEFT's use_dora=True, which is not supported")


@pytest.mark.parametrize("regex", [False, True])
def test_mlp_targets_are_written_so_peft_loads_them_and_both_forms_load_into_ours(regex, tmp_path):
    """PEFT retargets a target_modules entry ending in gate_proj / up_proj / down_proj onto the fused experts, a
    regular expression too (it resolves it to leaf names first): the folder names those linears by their weight in
    target_parameters and a regular expression by the module names it matched. Our reader takes that form, the
    job's own names (a folder written before) and the folder's options alike."""
    base = _tiny_deepseek_v3()
    tm = r"model\.layers\.1\.(self_attn\.q_b_proj|mlp\.shared_experts\.(gate|up|down)_proj)" if regex else DSV3_MODULES
    options = LoraOptions(rank=4, alpha=8, target_modules=tm, target_parameters=PARAMS)
    ours, adapters = _ours(base, options)
    save_adapter(tmp_path / "new", adapters, adapters.state_dict(ours))
    config = json.loads((tmp_path / "new/adapter_config.json").read_text())
    mlp_weights = [p for p in config["target_parameters"] if p.endswith(".weight")]
    if regex:
        assert config["target_modules"] == ["model.layers.1.self_attn.q_b_proj"] and len(mlp_weights) == 3
    else:
        assert sorted(config["target_modules"]) == sorted(DSV3_MODULES[:5])
        assert sorted(mlp_weights) == sorted(f"{m}.weight" for m in MLP)
    assert not any(m.endswith(MLP) for m in config["target_modules"])
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "new"))
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

    # the job's own names in the folder (as written before): PEFT misreads it, ours reads it
    (tmp_path / "old").mkdir()
    (tmp_path / "new/adapter_model.safetensors").rename(tmp_path / "old/adapter_model.safetensors")
    old = {**config, "target_modules": tm if regex else list(tm), "target_parameters": list(PARAMS)}
    (tmp_path / "old/adapter_config.json").write_text(json.dumps(old))
    want = adapters.state_dict(ours)
    got = load_adapter(tmp_path / "old", adapters)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    # a job made from the folder's own options (init_from) targets the same tensors and loads it too
    save_adapter(tmp_path / "new", adapters, want)
    folder_options = read_adapter_options(tmp_path / "new")
    fresh, fresh_adapters = _ours(base, LoraOptions(**{**folder_options.__dict__, "init_from": None}))
    assert sorted(t.base_name for t in fresh_adapters.targets) == sorted(t.base_name for t in adapters.targets)
    fresh_adapters.load_state_dict(fresh, load_adapter(tmp_path / "new", fresh_adapters))
    assert load_adapter(tmp_path / "new", adapters).keys() == want.keys()
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, ours(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["qwen3moe-dense-mlp", "deepseekv3"])
def test_all_linear_takes_what_peft_takes_and_peft_loads_it(family, tmp_path):
    """``target_modules="all-linear"`` (PEFT's shorthand) targets the linear modules PEFT's own resolution of it
    takes on the transformers model (every ``nn.Linear`` but the LM head; routers are no linears in either), and the
    folder it writes loads into PEFT with our logits."""
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    base = _tiny_deepseek_v3() if family == "deepseekv3" else _tiny_base(dense_layers=[0])
    options = LoraOptions(rank=4, alpha=8, target_modules="all-linear", target_parameters=PARAMS)
    ours, adapters = _ours(base, options)
    resolved = _maybe_include_all_linear_layers(peft.LoraConfig(target_modules="all-linear"), copy.deepcopy(base))
    linear = sorted(t.module for t in adapters.targets if t.kind == "linear")
    assert linear == sorted(resolved.target_modules) and "lm_head" not in linear
    assert any(m.endswith("mlp.down_proj") for m in linear)  # the dense layer's (and shared experts') MLP too
    save_adapter(tmp_path, adapters, adapters.state_dict(ours))
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # the folder's options (the module names all-linear took) target the same tensors again
    fresh, fresh_adapters = _ours(base, LoraOptions(**{**read_adapter_options(tmp_path).__dict__, "init_from": None}))
    assert sorted(t.base_name for t in fresh_adapters.targets) == sorted(t.base_name for t in adapters.targets)


def test_dropout_trains_as_peft_s_with_the_same_draws(base, tmp_path):
    """``dropout`` (PEFT's ``lora_dropout``) on attention adapters: in train mode, from one seed, the logits and the
    adapters' gradients are PEFT's (the same masks: each adapter draws its own in module order in both); the folder
    records it and reads it back."""
    options = LoraOptions(rank=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), dropout=0.3)
    ours, adapters = _ours(base, options)
    save_adapter(tmp_path, adapters, adapters.state_dict(ours))
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_dropout"] == 0.3
    assert read_adapter_options(tmp_path).dropout == 0.3
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path), is_trainable=True)
    ours.train(), theirs.train()
    ids = _batch()
    torch.manual_seed(11)
    a = _loss(ours, ids)
    torch.manual_seed(11)
    b = _loss(theirs, ids)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.backward(), b.backward()
    save_adapter(tmp_path / "grads", adapters, {n: p.grad for n, p in ours.named_parameters() if p.requires_grad})
    ours_grads = load_file(str(tmp_path / "grads/adapter_model.safetensors"))
    their_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert sorted(ours_grads) == sorted(their_grads)
    for n in ours_grads:
        torch.testing.assert_close(ours_grads[n], their_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    torch.manual_seed(11)
    assert not torch.allclose(_loss(ours.eval(), ids), a)  # evaluation draws no mask
