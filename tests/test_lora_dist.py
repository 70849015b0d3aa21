"""LoRA on the tiny Qwen3-MoE over 4 gloo ranks (EP 2 x ep_fsdp 2) against PEFT on transformers in one process.

Each rank builds our model on meta, adds the adapters (attention and experts), parallelizes it (the expert
adapters sharded with their experts: EP dim 0, then ep_fsdp), loads the base, gives the adapters their seeded
initial values and trains them with build_optimizer (AdamW over the adapters only) and clipping. The reference
is ``peft.PeftModel`` over transformers' model, started from the same initial adapter (saved in PEFT's format by
a one-process copy), on the same global batches. Then the trained adapter, saved in PEFT's format, loads in PEFT
with equal logits. float32 throughout.
"""

import copy

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.lora import LoraOptions
from moeshard.meshes.testing import run_distributed

peft = pytest.importorskip("peft", reason="the parity tests need the `test` extra (peft)")

STEPS, LR, MAX_NORM, B, S, VOCAB, SEED = 3, 1e-2, 1.0, 8, 12, 256, 3
ADAM = dict(lr=LR, weight_decay=0.0, eps=1e-6)
OPTIONS = LoraOptions(
    rank=4, alpha=8, target_modules=("q_proj", "o_proj"),
    target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
)  # fmt: skip
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=64, output_router_logits=False,
    router_aux_loss_coef=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny")
    torch.manual_seed(1234)
    HFQwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).save_pretrained(path)
    return str(path)


def _batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (B, S), generator=g) for _ in range(STEPS)]


def _body(path, out_dir):
    import torch.distributed as dist

    from moeshard.fsdp_moe import build_optimizer
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.lora import apply_lora, reset_adapters, save_adapter
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, parallelize
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config, load_hf_weights

    meshes = build_meshes(ep_size=2, device_type="cpu")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(path))
    adapters = apply_lora(model, OPTIONS, seed=SEED)
    parallel = parallelize(model, meshes, ParallelOptions(prefetch_depth=0))
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=parallel.ep_info)
    reset_adapters(model, adapters, SEED, ep_rank=parallel.ep_info.ep_rank)
    opt = build_optimizer(model, **ADAM)
    trained = {id(p) for o in opt.optimizers for g in o.param_groups for p in g["params"]}
    assert trained == {id(p) for p in adapters.parameters(model)}  # the base has no optimizer state
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if "lora" in n and "experts" in n}
    W, r = meshes.world_size, meshes.rank
    losses = []
    for ids in _batches():
        ids = ids.chunk(W)[r]
        loss = model(ids, labels=ids).loss  # every rank the same number of label tokens: the mean of means
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # no base gradient formed
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)
        losses.append(logged.item())
    full = full_tensors(model)
    if r == 0:
        save_adapter(out_dir, adapters, {n: full[n] for n in adapters.names()})
    dist.barrier()
    return losses, shapes


def _peft_reference(path, init_dir):
    from moeshard.lora import apply_lora, save_adapter
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    ours = Qwen3MoeForCausalLM.from_pretrained(path)
    adapters = apply_lora(ours, OPTIONS, seed=SEED)
    save_adapter(init_dir, adapters, adapters.state_dict(ours))  # the same initial adapter, PEFT's format
    base = HFQwen3MoeForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(init_dir), is_trainable=True).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, **ADAM, foreach=False)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lora_ep2x2_equals_peft_and_its_adapter_loads_in_peft(hf_dir, tmp_path):
    results = run_distributed(_body, 4, hf_dir, str(tmp_path / "trained"), ranks_per_node=2)
    ref = _peft_reference(hf_dir, tmp_path / "init")
    losses, shapes = results[0]
    assert all(res[0] == losses for res in results)
    assert ref[1] != ref[0]  # the adapters changed the loss after a step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-5)
    # the expert adapters: 2 of 4 experts per EP rank (dim 0), their dim 1 halved over ep_fsdp
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_lora_A"] == (2, 2, 32)
    assert shapes["model.layers.0.mlp.experts.down_proj_lora_B"] == (2, 16, 4)
    # the trained adapter in PEFT: the same logits as our model with it, one process
    from moeshard.lora import apply_lora, load_adapter
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    adapters = apply_lora(ours, OPTIONS, seed=0)
    adapters.load_state_dict(ours, load_adapter(tmp_path / "trained", adapters))
    base = HFQwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "trained"))
    ids = _batches()[0]
    with torch.no_grad():
        a, b, plain = ours(ids).logits, theirs(input_ids=ids).logits, base(input_ids=ids).logits
    assert (a - plain).abs().max() > 1e-4
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
