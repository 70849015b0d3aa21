"""The tiny Qwen3-MoE sharded by moeshard.fsdp_moe's shard_model on gloo (4 processes as 2 nodes x 2) against
transformers (a cross-package test: fsdp_moe with the model package).

Each rank builds our model on meta, applies EP, shards, materialises and loads the weights of a random tiny
transformers ``Qwen3MoeForCausalLM`` saved in a temporary directory; the reference trains that transformers
model in this (parent) process on the same global batches. float32 throughout.
"""

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.meshes.testing import run_distributed

STEPS, LR, MAX_NORM, B, S, VOCAB = 3, 3e-3, 0.3, 8, 12, 512
TOL = 1e-5  # relative: per entry against the tensor's largest entry (gradients), in norm (parameters)
# The gradients of steps 1 and 2, in norm: they start from parameters that differ by float32 rounding amplified by
# Adam (see _close_norm). The routed experts apply the routing weight before the down projection (transformers
# after it), another float32 rounding: step 0's gradients stay within 1e-6 entry by entry, while step 2's largest
# difference in norm went from 0.6e-5 to 1.4e-5 with it.
TOL_LATER = 3e-5
# eps 1e-6 rather than 1e-8 damps the effect described in _close_norm, which later steps' gradients inherit.
ADAM = dict(lr=LR, weight_decay=0.1, eps=1e-6)

# 3 layers, the middle one dense, 8 experts top-2: gate_up_proj [8, 64, 64], down_proj [8, 64, 32].
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    max_position_embeddings=64,
    output_router_logits=False,
    router_aux_loss_coef=0.0,
)


def _save_hf(path, **overrides):
    torch.manual_seed(1234)
    HFQwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, **overrides})).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _save_hf(tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture(scope="module")
def hf_aux_dir(tmp_path_factory):
    return _save_hf(tmp_path_factory.mktemp("hf_aux"), output_router_logits=True, router_aux_loss_coef=AUX_COEF)


def _batches(steps=STEPS):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[torch.rand(B, S, generator=g) < 0.25] = -100  # ranks see different numbers of label tokens
        out.append((ids, labels))
    return out


def _reference(path):
    model = HFQwen3MoeForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, foreach=False)
    steps = []
    for ids, labels in _batches():
        loss = model(ids, labels=labels).loss  # mean over the global batch's label tokens
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        steps.append((loss.item(), norm.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return steps


def _build(path, ep_size, foreach=False, checkpointing=False, **build_kwargs):
    """The sharded model and its optimizer container: ``build_optimizer(..., **build_kwargs)``, or with
    ``foreach`` torch's foreach AdamW over every parameter in a container; ``checkpointing``: full activation
    checkpointing (its recompute leaves out the routed experts' down projections and the way back)."""
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import OptimizersContainer, build_optimizer, shard_model
    from moeshard.meshes import build_meshes
    from moeshard.models.common import apply_activation_checkpointing, load_hf_weights
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config

    meshes = build_meshes(ep_size=ep_size, allow_cross_node_ep=True)  # EP 4 spans the two 2-rank nodes
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(path))
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    if checkpointing:
        apply_activation_checkpointing(model)
    units = shard_model(model, meshes, ep_info=ep_info)
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=ep_info)
    if foreach:
        opt = OptimizersContainer([torch.optim.AdamW(model.parameters(), **ADAM, foreach=True)])
    else:
        opt = build_optimizer(model, **ADAM, **build_kwargs)
    return meshes, model, units, opt


def _train(meshes, model, opt):
    """3 steps, each clipped through the container (the coefficient in the step where the optimizer takes it)."""
    import torch.distributed as dist

    from moeshard.fsdp_moe import OptimizersContainer, get_total_norm, num_items_for_global_mean
    from moeshard.fsdp_moe.testing import full_tensors

    W, r = meshes.world_size, meshes.rank
    steps = []
    for ids, labels in _batches():
        ids, labels = ids.chunk(W)[r], labels.chunk(W)[r]
        n = num_items_for_global_mean((labels[:, 1:] != -100).sum())  # N_global / W
        loss = model(ids, labels=labels, num_items_in_batch=n).loss  # W * sum_r / N_global
        loss.backward()
        grads = full_tensors(model, grads=True)
        # A plain tensor (the same on every rank) is counted once, beside the two meshes' shards.
        plain = torch.full((3,), 0.5, requires_grad=True)
        plain.grad = torch.full((3,), 0.5)
        with_plain = OptimizersContainer([*opt.optimizers, torch.optim.SGD([plain], lr=0.0)])
        extra = {
            "inf": get_total_norm(opt, float("inf")).item(),
            "with_plain": get_total_norm(with_plain).item(),
            "kinds": [type(o).__name__ for o in opt.optimizers],
        }
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG)  # the global-batch mean
        steps.append((logged.item(), norm.item(), _np(grads), _np(full_tensors(model, optimizer=opt)), extra))
    return steps


def _np(tensors):
    return {k: v.numpy() for k, v in tensors.items()}


def _layout(meshes, model, units):
    """Local shapes, placements and meshes of every parameter, and the stages' names."""
    out = {}
    for fqn, p in model.named_parameters():
        out[fqn] = (
            tuple(p.to_local().shape),
            tuple(p.shape),
            p.placements,
            p.device_mesh.mesh_dim_names,
            p.device_mesh.size(),
        )
    out["stages"] = [[name for name, _ in stage.modules] for stage in units.stages]
    return out


def _ep2x2(path):
    meshes, model, units, opt = _build(path, 2, foreach=True)  # foreach across the two meshes: in-place clip
    return _layout(meshes, model, units), _train(meshes, model, opt)


def _other_layouts(path):
    out = {}
    for ep, fuse in ((4, True), (4, False), (1, True)):
        # EP 4: torch's fused AdamW across the two meshes, the clip coefficient as its grad_scale (a plain scalar
        # tensor beside DTensors of two meshes), with full activation checkpointing; EP 4 x 1 fused: the local
        # experts' LocalExpertAdamW beside it. EP 1 x ep_fsdp 4: build_optimizer's default, OnePassAdamW over both
        # meshes (the experts' Shard(1) pieces are not contiguous), the coefficient as its grad_mult.
        fused = {"fused": True} if ep == 4 else {}
        checkpointing = (ep, fuse) == (4, False)
        meshes, model, _, opt = _build(path, ep, fuse_local_experts=fuse, checkpointing=checkpointing, **fused)
        out[(ep, fuse)] = _train(meshes, model, opt)
    return out


def _close(a, b, what):
    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL * float(b.abs().max()), msg=lambda m: f"{what}: {m}")


def _close_norm(a, b, what, tol=TOL):
    # Adam's first step on an entry is about lr * sign(grad): where a gradient entry is tiny (a cancellation,
    # ~1e-6 of the tensor's largest), float32 rounding of another summation order changes that one entry's step
    # by up to ~lr * 1e-3. Parameters are therefore compared in norm; gradients entry by entry.
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err = float((a - b).norm() / b.norm())
    assert err <= tol, f"{what}: relative error in norm {err:.2e} > {tol}"


def _compare(steps, ref, what):
    for i, ((loss, norm, grads, params, extra), (rl, rn, rg, rp)) in enumerate(zip(steps, ref, strict=True)):
        _close(loss, rl, f"{what} step {i} loss")
        _close(norm, rn, f"{what} step {i} grad norm")
        _close(extra["inf"], max(g.abs().max() for g in rg.values()), f"{what} step {i} max norm")
        _close(extra["with_plain"], (rn**2 + 0.75) ** 0.5, f"{what} step {i} norm with a plain tensor")
        assert grads.keys() == rg.keys() and params.keys() == rp.keys(), what
        for k in rg:
            # Step 0 entry by entry; later steps start from parameters that already differ by float32 rounding
            # amplified by Adam (see _close_norm), so their gradients are compared in norm.
            if i == 0:
                _close(torch.from_numpy(grads[k]), rg[k], f"{what} step {i} gradient of {k}")
            else:
                _close_norm(torch.from_numpy(grads[k]), rg[k], f"{what} step {i} gradient of {k}", TOL_LATER)
            _close_norm(torch.from_numpy(params[k]), rp[k], f"{what} step {i} parameter {k}")


@pytest.fixture(scope="module")
def reference(hf_dir):
    return _reference(hf_dir)


def _every_layout(path, aux_path):
    return {"ep2x2": _ep2x2(path), "others": _other_layouts(path), "aux": _aux_step(aux_path)}


@pytest.fixture(scope="module")
def ranks(hf_dir, hf_aux_dir):
    """Per rank: every distributed part of this file, from one launch of 4 processes (a launch costs more than
    the runs)."""
    return run_distributed(_every_layout, 4, hf_dir, hf_aux_dir, ranks_per_node=2, timeout=400)


def test_ep2_ep_fsdp2_layout_and_training_match_transformers(ranks, reference):
    results = [r["ep2x2"] for r in ranks]
    layout, _ = results[0]
    expert_shapes = {"gate_up_proj": (8, 64, 64), "down_proj": (8, 64, 32)}
    for fqn, (local, full, placements, mesh_names, mesh_size) in layout.items():
        if fqn == "stages":
            continue
        if ".mlp.experts." in fqn:
            E, d1, d2 = expert_shapes[fqn.rsplit(".", 1)[1]]
            assert full == (E // 2, d1, d2), fqn  # the DTensor over ep_fsdp spans this EP rank's experts
            assert local == (E // 2, d1 // 2, d2), fqn
            assert (placements, mesh_names, mesh_size) == ((Shard1,), ("ep_fsdp",), 2), fqn
        else:
            assert (placements, mesh_names, mesh_size) == ((Shard0,), ("fsdp",), 4), fqn
    assert sum(".mlp.experts." in k for k in layout) == 4  # layers 0 and 2 (layer 1 is dense)
    assert layout["stages"] == [
        ["model.embed_tokens"],
        ["model.layers.0", "model.layers.0.mlp.experts"],
        ["model.layers.1"],
        ["model.layers.2", "model.layers.2.mlp.experts"],
        ["lm_head"],
    ]
    for rank, (_, steps) in enumerate(results):
        _compare(steps, reference, f"EP 2 x ep_fsdp 2, rank {rank}")


def test_ep4_and_ep_fsdp4_match_transformers(ranks, reference):
    out = ranks[0]["others"]
    _compare(out[(4, True)], reference, "EP 4 x ep_fsdp 1, LocalExpertAdamW")
    _compare(out[(4, False)], reference, "EP 4 x ep_fsdp 1, torch's AdamW, full activation checkpointing")
    _compare(out[(1, True)], reference, "EP 1 x ep_fsdp 4, OnePassAdamW")
    assert out[(4, True)][0][4]["kinds"] == ["LocalExpertAdamW", "AdamW"]
    assert out[(4, False)][0][4]["kinds"] == ["AdamW"]
    assert out[(1, True)][0][4]["kinds"] == ["OnePassAdamW"]


# ---- the router aux loss --------------------------------------------------------------------------------------
AUX_COEF = 0.05


def _aux_step(path):
    from moeshard.fsdp_moe.testing import full_tensors

    meshes, model, _, _ = _build(path, 2)
    ids, labels = _batches(1)[0]
    ids = ids.chunk(meshes.world_size)[meshes.rank]
    # Equal label counts on every rank here, so the plain per-rank mean is the LM part's share.
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()  # lm_r + coef * aux_r, aux_r from this rank's tokens only
    return _np(full_tensors(model, grads=True))


def test_aux_loss_is_the_mean_of_per_rank_aux_losses(ranks, hf_aux_dir):
    """Each rank's aux loss is computed from its own tokens' router logits (no communication), and gradients are
    averaged over the W ranks, so training minimises ``mean_r aux(tokens of rank r)``: load balance per rank's
    micro-batch, not over the global batch (the aux loss is not linear in the tokens, so the two differ).
    Equal to transformers run on each rank's chunk, losses averaged."""
    model = HFQwen3MoeForCausalLM.from_pretrained(hf_aux_dir, attn_implementation="sdpa", dtype=torch.float32).train()
    ids, _ = _batches(1)[0]
    W = 4
    chunks = ids.chunk(W)
    per_rank = sum(model(c, labels=c).loss for c in chunks) / W
    per_rank.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids, labels=ids).loss.backward()  # aux loss over the global batch: not what distributed training does
    global_aux = {n: p.grad.clone() for n, p in model.named_parameters()}

    grads = ranks[0]["aux"]
    router = "model.layers.0.mlp.gate.weight"
    for k, g in expected.items():
        _close(torch.from_numpy(grads[k]), g, f"gradient of {k}")
    assert not torch.allclose(global_aux[router], expected[router], rtol=1e-3, atol=0)


from torch.distributed.tensor import Shard  # noqa: E402 - the expected placements above

Shard0, Shard1 = Shard(0), Shard(1)
