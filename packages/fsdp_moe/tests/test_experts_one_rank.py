"""Experts on a one-rank ep_fsdp mesh (EP 2 x ep_fsdp 1 on 2 gloo processes) are kept out of FSDP.

Their parameters are float32 ``Shard(1)`` DTensors on ``ep_fsdp`` that no FSDP unit manages, cast to the compute
dtype in the expert module's own forward. Checked against the same model with expert FSDP units forced
(``fsdp_experts_on_one_rank=True``, the FSDP2 path): the weights after ``to_empty`` + ``load_hf_weights`` or
``init_weights``, losses, gradients and parameters over 3 AdamW steps of 2 micro-batches each, with bf16 compute
and activation checkpointing, and with float32; plus DCP checkpoints moving EP 2 x 1 -> EP 1 x 2 -> EP 2 x 1.
(EP 4 x 1 against transformers is in test_qwen3moe_dist.py.)
"""

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.fsdp_moe import expert_grad
from moeshard.meshes.testing import run_distributed

VOCAB, B, S, STEPS, MICRO = 256, 8, 10, 3, 2
# 2 layers, both MoE, 8 experts top-2: gate_up_proj [8, 32, 32], down_proj [8, 32, 16].
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=32,
    output_router_logits=False,
    router_aux_loss_coef=0.0,
)
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
# (compute dtype, activation checkpointing, weights from)
CONFIGS = {
    "bf16-ac-init": (torch.bfloat16, True, "init"),
    "fp32-hf": (None, False, "hf"),
    "bf16-noac": (torch.bfloat16, False, "init"),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny_one_rank")
    torch.manual_seed(4321)
    HFQwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).save_pretrained(path)
    return str(path)


def _batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (B, S), generator=g)
        labels = ids.clone()
        labels[torch.rand(B, S, generator=g) < 0.25] = -100
        out.append((ids, labels))
    return out


def _fsdp_managed(units):
    """ids of every parameter some FSDP unit manages (FSDP2's private state: test-only)."""
    ids = set()
    for _, module in units:
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
        ids |= {id(p.sharded_param) for g in groups for p in g.fsdp_params}
    return ids


def _np(tensors):
    return {k: v.float().numpy() for k, v in tensors.items()}


def _run(path, config, force, fused=None):
    """``fused``: None (torch's AdamW alone), "inplace" (fuse_local_expert_updates, clipped in place) or
    "handover" (the same with torch's fused AdamW and the clip coefficient handed to it; also without fusing the
    experts when ``force`` is "handover-ref")."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import clip_grad_norm_, fuse_local_expert_updates, num_items_for_global_mean, shard_model
    from moeshard.fsdp_moe._local_experts import local_experts_state
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.meshes import build_meshes
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config, load_hf_weights
    from moeshard.prefetch import apply_schedule, build_schedule

    dtype, ac, weights = CONFIGS[config]
    meshes = build_meshes(ep_size=2, device_type="cpu")
    assert (meshes.ep_size, meshes.ep_fsdp_size) == (2, 1)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(path))
    if ac:
        model.enable_activation_checkpointing()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    units = shard_model(model, meshes, mp_policy=mp, fsdp_experts_on_one_rank=force is True)
    schedule = build_schedule(units.stages, depth=1)
    apply_schedule(schedule)
    model.to_empty(device="cpu")
    if weights == "hf":
        load_hf_weights(model, path)
    else:
        # Seeded as the trainer does (DTensor's random ops draw from the default generator, synced from rank 0).
        torch.manual_seed(3)
        model.init_weights()
    handover = fused == "handover" or force == "handover-ref"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6, fused=handover or None)
    n_fused = fuse_local_expert_updates(model, opt) if fused else 0

    seen = []  # what the expert module's forward sees as its weights (hook registered after shard_model's)
    model.get_submodule(EXPERTS[0]).register_forward_pre_hook(
        lambda m, args: seen.append((isinstance(m.gate_up_proj, DTensor), m.gate_up_proj.dtype))
    )
    managed = _fsdp_managed(units)
    layout = {
        "stages": [[n for n, _ in s.modules] for s in units.stages],
        "stage_local": [list(s.local_experts) for s in units.stages],
        "experts": [n for n, _ in units.experts],
        "local_experts": [n for n, _ in units.local_experts],
        "fsdp_modules": [n for n in EXPERTS if isinstance(model.get_submodule(n), FSDPModule)],
        "describe": units.describe(),
        "schedule": schedule.as_dict(),
    }
    for fqn, p in model.named_parameters():
        if ".mlp.experts." in fqn:
            layout[fqn] = (
                type(p).__name__,
                p.placements,
                p.device_mesh.mesh_dim_names,
                p.device_mesh.size(),
                p.dtype,
                id(p) in managed,
            )
    initial = _np(full_tensors(model))
    W, r = meshes.world_size, meshes.rank
    steps = []
    for ids, labels in _batches():
        ids, labels = ids.chunk(W)[r], labels.chunk(W)[r]
        n = num_items_for_global_mean((labels[:, 1:] != -100).sum())
        loss_sum = torch.zeros(())
        for mids, mlabels in zip(ids.chunk(MICRO), labels.chunk(MICRO)):  # gradient accumulation
            loss = model(mids, labels=mlabels, num_items_in_batch=n).loss
            loss.backward()
            loss_sum += loss.detach()
        grads = full_tensors(model, grads=True)
        grad_info = {
            fqn: (type(g).__name__, g.placements, g.dtype, p.grad is None)
            for fqn, p in model.named_parameters()
            if ".mlp.experts." in fqn and (g := expert_grad(p)) is not None
        }
        norm = clip_grad_norm_(model, 0.5, optimizer=opt if handover else None)
        opt.step()
        opt.zero_grad()
        if fused:  # the kept compute copies are the new masters, cast
            for name in EXPERTS:
                st = local_experts_state(model.get_submodule(name))
                assert not st.pending
                for pname, (copy, local, _) in st.copies.items():
                    assert torch.equal(copy, local.to(copy.dtype)), (name, pname)
                    assert local is st.params[pname]._local_tensor
        dist.all_reduce(loss_sum)
        steps.append((loss_sum.item() / W, norm.item(), _np(grads), _np(full_tensors(model)), grad_info))
    layout["fused"] = n_fused
    return layout, seen, initial, steps


# (forced expert FSDP units, fused expert updates) of each run
RUNS = {
    False: (False, None),
    True: (True, None),
    "fused": (False, "inplace"),
    "fused-handover": (False, "handover"),
    "handover-ref": ("handover-ref", None),
}


@pytest.fixture(scope="module")
def results(hf_dir):
    """Per rank: ``{(config, run): _run(...)}``; each run in fresh processes (DTensor's random-number state
    lives in the process, so a second model initialised in it would draw other numbers)."""
    runs = {(c, k): run_distributed(_run, 2, hf_dir, c, *RUNS[k]) for c in CONFIGS for k in RUNS}
    return [{key: per_rank[rank] for key, per_rank in runs.items()} for rank in range(2)]


def test_experts_are_dtensors_outside_fsdp(results):
    for rank_result in results:
        for config, (dtype, _, _) in CONFIGS.items():
            layout, seen, _, steps = rank_result[(config, False)]
            assert layout["experts"] == [] and layout["fsdp_modules"] == []
            assert layout["local_experts"] == EXPERTS
            # A decoder layer's stage holds its FSDP unit alone; the experts are listed beside it.
            assert layout["stages"] == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["lm_head"]]
            assert layout["stage_local"] == [[], [EXPERTS[0]], [EXPERTS[1]], []]
            assert f"{EXPERTS[0]} [ep_fsdp x1, no FSDP]" in layout["describe"]
            assert [s["forward"] for s in layout["schedule"]["stages"]][:2] == [["model.layers.0"], ["model.layers.1"]]
            for name in ("gate_up_proj", "down_proj"):
                for layer in (0, 1):
                    fqn = f"model.layers.{layer}.mlp.experts.{name}"
                    # A float32 master DTensor Shard(1) on the one-rank ep_fsdp mesh, managed by no FSDP unit.
                    assert layout[fqn] == ("DTensor", (Shard1,), ("ep_fsdp",), 1, torch.float32, False), fqn
                    for *_, grad_info in steps:
                        assert grad_info[fqn] == ("DTensor", (Shard1,), torch.float32, False), fqn
            # The forward computes with plain local tensors in the compute dtype (forward + recomputation).
            assert set(seen) == {(False, dtype or torch.float32)}
            if CONFIGS[config][1]:  # recomputed in backward (at least once per forward)
                assert len(seen) >= 2 * STEPS * MICRO, len(seen)
            else:
                assert len(seen) == STEPS * MICRO, len(seen)
            # The forced FSDP path: expert units, managed parameters.
            forced, *_ = rank_result[(config, True)]
            assert forced["experts"] == EXPERTS and forced["local_experts"] == [] and forced["fsdp_modules"] == EXPERTS
            assert forced[f"{EXPERTS[0]}.gate_up_proj"][-1] is True


def test_same_numbers_as_expert_fsdp_units(results):
    """Weights after materialisation, losses, grad norms, gradients and parameters after each AdamW step equal the
    FSDP2 path's bit for bit (the same casts, the same 1/W factor)."""
    for rank, rank_result in enumerate(results):
        for config in CONFIGS:
            _, _, init_new, steps_new = rank_result[(config, False)]
            _, _, init_old, steps_old = rank_result[(config, True)]
            _same(init_new, init_old, f"rank {rank} {config} initial weights")
            for i, (new, old) in enumerate(zip(steps_new, steps_old, strict=True)):
                what = f"rank {rank} {config} step {i}"
                assert new[0] == old[0], f"{what} loss {new[0]} != {old[0]}"
                assert new[1] == old[1], f"{what} grad norm {new[1]} != {old[1]}"
                _same(new[2], old[2], f"{what} gradients")
                _same(new[3], old[3], f"{what} parameters")
            assert all(np.isfinite([s[0] for s in steps_new]))


def test_fused_expert_updates_same_numbers(results):
    """fuse_local_expert_updates: param.grad stays None for the local experts, their pending gradients (as
    expert_grad shows them), the clipped norms, losses and the parameters after each step equal torch's AdamW's bit
    for bit (clipped in place), and to float32 rounding with the fused AdamW and the clip coefficient handed over."""
    for rank, rank_result in enumerate(results):
        for config in CONFIGS:
            layout, _, init_f, steps_f = rank_result[(config, "fused")]
            _, _, init_ref, steps_ref = rank_result[(config, False)]
            assert layout["fused"] == 4  # gate_up_proj and down_proj of 2 layers
            _same(init_f, init_ref, f"rank {rank} {config} initial weights")
            for i, (new, old) in enumerate(zip(steps_f, steps_ref, strict=True)):
                what = f"rank {rank} {config} fused step {i}"
                assert new[0] == old[0] and new[1] == old[1], (what, new[:2], old[:2])
                _same(new[2], old[2], f"{what} gradients")
                _same(new[3], old[3], f"{what} parameters")
                assert {k: v[:3] for k, v in new[4].items()} == {k: v[:3] for k, v in old[4].items()}
                assert all(v[3] for v in new[4].values()), f"{what}: param.grad of a fed expert was set"
            _, _, _, steps_h = rank_result[(config, "fused-handover")]
            _, _, _, steps_hr = rank_result[(config, "handover-ref")]
            for i, (new, old) in enumerate(zip(steps_h, steps_hr, strict=True)):
                what = f"rank {rank} {config} fused with hand-over, step {i}"
                np.testing.assert_allclose(new[0], old[0], rtol=1e-6, err_msg=what)
                np.testing.assert_allclose(new[1], old[1], rtol=1e-5, err_msg=what)
                for k, v in old[3].items():
                    np.testing.assert_allclose(new[3][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{what}: {k}")
                # the update really moved the experts (a clip coefficient below 1 was applied)
                assert not np.array_equal(new[3][f"{EXPERTS[0]}.down_proj"], init_f[f"{EXPERTS[0]}.down_proj"])
            assert max(s[1] for s in steps_hr) > 0.5, "the clip never engaged: the hand-over is not exercised"


def test_loaded_weights_are_the_checkpoints(results, hf_dir):
    """``to_empty`` + ``load_hf_weights`` fills the local experts (nothing left as uninitialised memory)."""
    hf = HFQwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    _, _, initial, _ = results[0][("fp32-hf", False)]
    assert set(initial) <= set(hf) and any(".mlp.experts." in k for k in initial)
    for k, v in initial.items():
        np.testing.assert_array_equal(v, hf[k].numpy(), err_msg=k)


def _same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")


# ---- checkpoints between EP 2 x ep_fsdp 1 (no expert FSDP) and EP 1 x ep_fsdp 2 (expert FSDP units) -----------


def _toy(ep_size, seed, lr):
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=ep_size, device_type="cpu")
    torch.manual_seed(seed)
    model = ToyMoELM()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    units = shard_model(model, meshes)
    assert bool(units.local_experts) == (ep_size == 2) and bool(units.experts) == (ep_size == 1)
    return meshes, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _toy_step(model, opt, meshes, seed):
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(seed)).chunk(meshes.world_size)
    model(ids[meshes.rank], ids[meshes.rank]).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    from moeshard.fsdp_moe.testing import checkpoint_snapshot

    return checkpoint_snapshot(model, opt)


def _round_trip(path):
    from moeshard.fsdp_moe import load_checkpoint, save_checkpoint

    out = {}
    meshes, model, opt = _toy(2, seed=0, lr=1e-2)  # EP 2 x 1: experts outside FSDP
    _toy_step(model, opt, meshes, seed=1)
    save_checkpoint(f"{path}/a", model, opt)
    out["saved 2x1"] = _snapshot(model, opt)
    _toy_step(model, opt, meshes, seed=2)
    out["next 2x1"] = _snapshot(model, opt)

    meshes, model, opt = _toy(1, seed=7, lr=1e-2)  # EP 1 x 2: expert FSDP units; other initial weights
    load_checkpoint(f"{path}/a", model, opt)
    out["loaded 1x2"] = _snapshot(model, opt)
    _toy_step(model, opt, meshes, seed=2)
    out["next 1x2"] = _snapshot(model, opt)
    save_checkpoint(f"{path}/b", model, opt)

    meshes, model, opt = _toy(2, seed=9, lr=1e-2)  # and back
    load_checkpoint(f"{path}/b", model, opt)
    out["loaded back 2x1"] = _snapshot(model, opt)
    return out


def test_checkpoint_moves_between_ep2x1_and_ep1x2(tmp_path):
    for snaps in run_distributed(_round_trip, 2, str(tmp_path)):
        assert any(".experts." in k and "exp_avg" in k for k in snaps["saved 2x1"])
        _same(snaps["loaded 1x2"], snaps["saved 2x1"], "EP 1 x 2 loading EP 2 x 1")
        _same(snaps["loaded back 2x1"], snaps["next 1x2"], "EP 2 x 1 loading EP 1 x 2")
        # The restored optimizer state drives the next step the same way on the other layout.
        for k, v in snaps["next 2x1"].items():
            np.testing.assert_allclose(snaps["next 1x2"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


from torch.distributed.tensor import Shard  # noqa: E402 - the expected placements above

Shard1 = Shard(1)
