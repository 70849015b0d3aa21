"""Experts on a one-rank ep_fsdp mesh (EP 2 x ep_fsdp 1 on 2 gloo processes) are kept out of FSDP (moeshard.fsdp_moe
with the Qwen3-MoE model and moeshard.prefetch: a cross-package test).

Their parameters are float32 ``Shard(1)`` DTensors on ``ep_fsdp`` that no FSDP unit manages, cast to the compute
dtype in the expert module's own forward. Checked against the same model with expert FSDP units forced
(``fsdp_experts_on_one_rank=True``, the FSDP2 path): the weights after ``to_empty`` + ``load_hf_weights`` or
``init_weights``, losses, gradients and parameters over 3 AdamW steps of 2 micro-batches each, with bf16 compute
and activation checkpointing, and with float32; the same with ``LocalExpertAdamW`` updating them (the parameters
in the compute dtype, the float32 masters in the optimizer) against torch's AdamW; plus DCP checkpoints moving
EP 2 x 1 -> EP 1 x 2 -> EP 2 x 1. (EP 4 x 1 against transformers is in test_fsdp_moe_qwen3moe_dist.py.)
"""

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

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
}  # bf16 without checkpointing: packages/fsdp_moe/tests/test_fused_update.py


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


def _run(path, config, force, optim):
    """``optim``: "unfused" (``build_optimizer(..., fuse_local_experts=False)``: torch's for-loop AdamW, clipped in
    place), "fused" (LocalExpertAdamW beside the for-loop AdamW), "fused-handover" (LocalExpertAdamW beside torch's
    fused AdamW: both take the clip coefficient in their step) or "handover-ref" (torch's fused AdamW alone)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import build_optimizer, num_items_for_global_mean, shard_model, split_master
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.meshes import build_meshes
    from moeshard.models.common import apply_activation_checkpointing, load_hf_weights
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_config
    from moeshard.prefetch import apply_schedule, build_schedule

    dtype, ac, weights = CONFIGS[config]
    meshes = build_meshes(ep_size=2, device_type="cpu")
    assert (meshes.ep_size, meshes.ep_fsdp_size) == (2, 1)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(path))
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    if ac:
        apply_activation_checkpointing(model)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    units = shard_model(model, meshes, ep_info=ep_info, mp_policy=mp, fsdp_experts_on_one_rank=force is True)
    schedule = build_schedule(units.stages, depth=1)
    apply_schedule(schedule)
    model.to_empty(device="cpu")
    if weights == "hf":
        load_hf_weights(model, path, ep_info=ep_info)
    else:
        # Seeded as the trainer does (DTensor's random ops draw from the default generator, synced from rank 0).
        torch.manual_seed(3)
        model.init_weights()
    opt = build_optimizer(
        model,
        lr=3e-3,
        weight_decay=0.1,
        eps=1e-6,
        fused=optim in ("fused-handover", "handover-ref"),
        fuse_local_experts=optim.startswith("fused"),
    )
    fused = optim.startswith("fused")
    kinds = [type(o).__name__ for o in opt.optimizers]

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
    initial = _np(full_tensors(model, optimizer=opt))
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
        grads = full_tensors(model, grads=True)  # (fused: as the update reads them, the divide factor applied)
        grad_info = {
            fqn: (type(p.grad).__name__, p.grad.placements, p.grad.dtype)
            for fqn, p in model.named_parameters()
            if ".mlp.experts." in fqn and p.grad is not None
        }
        norm = opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        if fused:  # the parameters the next forward uses are the new masters, cast
            local = opt.optimizers[0]
            for fqn, p in model.named_parameters():
                if ".mlp.experts." in fqn:
                    master = local.master(p).to_local()  # bf16: held split, the parameter its high half
                    cast = split_master(master)[0] if p.dtype == torch.bfloat16 else master.to(p.dtype)
                    assert torch.equal(p.to_local(), cast), fqn
        dist.all_reduce(loss_sum)
        steps.append((loss_sum.item() / W, norm.item(), _np(grads), _np(full_tensors(model, optimizer=opt)), grad_info))
    layout["kinds"] = kinds
    return layout, seen, initial, steps


# (forced expert FSDP units, optimizer) of each run
RUNS = {
    False: (False, "unfused"),
    True: (True, "unfused"),
    "fused": (False, "fused"),
    "fused-handover": (False, "fused-handover"),
    "handover-ref": (False, "handover-ref"),
}


def _all_runs(path, ckpt_dir):
    """Every ``(config, run)`` of :data:`RUNS` and the checkpoint round trip, in one pair of processes. DTensor's
    random-number tracker lives in the process and would give a second model other numbers: it is dropped before
    each run, so the next ``init_weights`` syncs a new one from the seeded default generator, as a fresh process
    does (the runs' equal initial weights below check it)."""
    from torch.distributed.tensor import _random

    out = {}
    for c in CONFIGS:
        for k in RUNS:
            _random._rng_tracker = None  # test-only: DTensor's private per-process state
            out[(c, k)] = _run(path, c, *RUNS[k])
    out["round_trip"] = _round_trip(ckpt_dir)
    return out


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory):
    """Per rank: ``{(config, run): _run(...), "round_trip": _round_trip(...)}`` (one launch: a pair of processes
    costs more than the runs)."""
    return run_distributed(_all_runs, 2, hf_dir, str(tmp_path_factory.mktemp("round_trip")), timeout=400)


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
                        assert grad_info[fqn] == ("DTensor", (Shard1,), torch.float32), fqn
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


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _all(d, keys):
    return np.concatenate([np.asarray(d[k], dtype=np.float64).ravel() for k in keys])


def test_local_expert_adamw_same_numbers(results):
    """LocalExpertAdamW (the expert parameters in the compute dtype, their float32 masters in the optimizer, the
    clip coefficient in its step) against torch's AdamW over the float32 experts: losses, grad norms, gradients (as
    the update reads them) and each step's update.

    float32 compute: to float32 rounding (the 2 micro-batches' gradients summed before the divide factor instead of
    after it; the clip coefficient multiplied in rather than divided out by torch's fused kernel), tensor by tensor.
    bf16 compute: the first step, from equal weights, within the bf16 sum of the 2 micro-batches' gradients
    (2^-9 relative, see LocalExpertAdamW) tensor by tensor; later steps start from weights that differ by that much
    and compute in bf16, which decorrelates the smallest gradients (a router's of ~1e-12): compared over the whole
    model."""
    for rank, rank_result in enumerate(results):
        for config, (dtype, _, _) in CONFIGS.items():
            for run, ref_run in (("fused", False), ("fused-handover", "handover-ref")):
                layout, seen, init_f, steps_f = rank_result[(config, run)]
                _, _, init_ref, steps_ref = rank_result[(config, ref_run)]
                assert layout["kinds"] == ["LocalExpertAdamW", "AdamW"]
                assert rank_result[(config, ref_run)][0]["kinds"] == ["AdamW"]
                compute = dtype or torch.float32
                for fqn in (f"{EXPERTS[0]}.gate_up_proj", f"{EXPERTS[1]}.down_proj"):
                    assert layout[fqn] == ("DTensor", (Shard1,), ("ep_fsdp",), 1, compute, False), fqn
                assert set(seen) == {(False, compute)}
                _same(init_f, init_ref, f"rank {rank} {config} {run} initial weights (the masters)")
                bf16 = dtype is not None
                prev_f, prev_ref = init_f, init_ref
                for i, (new, old) in enumerate(zip(steps_f, steps_ref, strict=True)):
                    what = f"rank {rank} {config} {run} step {i}"
                    np.testing.assert_allclose(new[0], old[0], rtol=1e-4 if bf16 else 1e-6, err_msg=f"{what} loss")
                    np.testing.assert_allclose(new[1], old[1], rtol=1e-3 if bf16 else 1e-6, err_msg=f"{what} norm")
                    grads, params = list(old[2]), list(old[3])
                    assert list(new[2]) == grads and list(new[3]) == params, what
                    upd_f = {k: new[3][k] - prev_f[k] for k in params}
                    upd_ref = {k: old[3][k] - prev_ref[k] for k in params}
                    if not bf16 or i == 0:
                        for k in grads:
                            err = _rel(new[2][k], old[2][k])
                            assert err <= (4e-3 if bf16 else 1e-6), (what, "gradient", k, err)
                        for k in params:
                            err = _rel(upd_f[k], upd_ref[k])
                            assert err <= (1e-3 if bf16 else 1e-4), (what, "update", k, err)
                    assert _rel(_all(new[2], grads), _all(old[2], grads)) <= (2e-2 if bf16 else 1e-6), what
                    # bf16's later updates: AdamW's m / sqrt(v) turns a decorrelated gradient of ~1e-12 into an update
                    # of ~lr either way, so the whole model's update differs by the CPU's kernels' share of such
                    # elements: step 2's 0.018 with ATEN_CPU_CAPABILITY=default, 0.037 with avx2. The parameters
                    # they reach are checked too (5e-4 and 9e-4 there, against a bound of 3e-3).
                    assert _rel(_all(upd_f, params), _all(upd_ref, params)) <= (6e-2 if bf16 else 1e-5), what
                    assert _rel(_all(new[3], params), _all(old[3], params)) <= (3e-3 if bf16 else 1e-6), what
                    for fqn, info in new[4].items():  # param.grad: the compute dtype, before the divide factor
                        assert info == ("DTensor", (Shard1,), compute), (what, fqn, info)
                    prev_f, prev_ref = new[3], old[3]
            assert max(s[1] for s in rank_result[(config, "handover-ref")][3]) > 0.5, "the clip never engaged"


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
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    units = shard_model(model, meshes, ep_info=ep_info)
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


def test_checkpoint_moves_between_ep2x1_and_ep1x2(results):
    for snaps in (r["round_trip"] for r in results):
        assert any(".experts." in k and "exp_avg" in k for k in snaps["saved 2x1"])
        _same(snaps["loaded 1x2"], snaps["saved 2x1"], "EP 1 x 2 loading EP 2 x 1")
        _same(snaps["loaded back 2x1"], snaps["next 1x2"], "EP 2 x 1 loading EP 1 x 2")
        # The restored optimizer state drives the next step the same way on the other layout.
        for k, v in snaps["next 2x1"].items():
            np.testing.assert_allclose(snaps["next 1x2"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


from torch.distributed.tensor import Shard  # noqa: E402 - the expected placements above

Shard1 = Shard(1)
