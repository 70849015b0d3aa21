"""EP over gloo (2 and 4 processes) against the single-process plain reference with all experts.

Each rank builds the same global problem from a seed, keeps its own tokens and (through apply_ep) its own
experts, runs routed_experts forward and backward; the parent compares outputs, input and routing-weight
gradients and the local expert-weight gradients with the reference in float32.
"""

import itertools

import torch
import torch.distributed as dist

from moeshard.ep import apply_ep, ep_group, get_ep_info, routed_experts, set_ep_dispatch
from moeshard.ep.testing import ToyMoE, count_host_syncs, reference_routed_experts, toy_plan
from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed

# T tokens, K top-k, D hidden, E experts, F expert width
E, D, F = 8, 16, 8
CASES = ("random", "one_expert", "rank_without_tokens", "skewed")
BACKENDS = ("loop", "grouped_mm")  # grouped_mm runs on CPU at these shapes (16-byte aligned rows)
# (expert GEMM backend, EP dispatch): both dispatch modes with both backends.
VARIANTS = (("loop", "tokens"), ("loop", "copies"), ("grouped_mm", "tokens"), ("grouped_mm", "copies"))


def _problem(world: int, case: str):
    """Per-rank tokens, ids, weights and upstream grads of one global problem (the same on every process)."""
    g = torch.Generator().manual_seed(100 * CASES.index(case) + world)
    K = 1 if case == "one_expert" else 2
    per_rank = []
    for r in range(world):
        T = 0 if (case == "rank_without_tokens" and r == 1) else 5 + 3 * r
        x_TD = torch.randn(T, D, generator=g)
        if case == "one_expert":
            ids_TK = torch.full((T, 1), 1)  # every copy to expert 1, on rank 0: the others receive nothing
        elif case == "skewed":
            # every token's first choice is the last expert, the second one of the others
            ids_TK = torch.stack([torch.full((T,), E - 1), torch.randint(E - 1, (T,), generator=g)], dim=1)
        else:
            ids_TK = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :K]  # K distinct experts per token
        w_TK = torch.rand(T, K, generator=g).softmax(-1)
        gy_TD = torch.randn(T, D, generator=g)
        per_rank.append((x_TD, ids_TK.long(), w_TK, gy_TD))
    return per_rank


def _model():
    torch.manual_seed(0)
    return ToyMoE(num_layers=1, num_experts=E, hidden=D, width=F)


def _forward_backward(fn, x_TD, ids_TK, w_TK, gy_TD, w1, w2, **kw):
    x_TD = x_TD.clone().requires_grad_(True)
    w_TK = w_TK.clone().requires_grad_(True)
    y_TD = fn(x_TD, ids_TK, w_TK, w1, w2, **kw)
    return y_TD, x_TD, w_TK


def _plain(obj):
    """Tensors as numpy arrays: torch's queue would share tensor storage, which dies with the worker."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _ep_layer_body():
    world, rank = dist.get_world_size(), dist.get_rank()
    meshes = build_meshes(ep_size=world, device_type="cpu")
    model = _model()
    info = apply_ep(model, toy_plan(), meshes.ep)
    experts = model.layers[0].mlp.experts
    group = ep_group(experts)
    out = {"info": info, "group_size": dist.get_world_size(group)}
    for case, (backend, dispatch) in itertools.product(CASES, VARIANTS):
        set_ep_dispatch(dispatch)
        x_TD, ids_TK, w_TK, gy_TD = _problem(world, case)[rank]
        experts.zero_grad(set_to_none=True)
        x_TD.requires_grad_(True)
        w_TK.requires_grad_(True)
        with count_host_syncs() as fwd_syncs:
            y_TD = routed_experts(
                x_TD,
                ids_TK,
                w_TK,
                experts.gate_up_proj,
                experts.down_proj,
                num_experts=E,
                ep_group=group,
                backend=backend,
            )
        with count_host_syncs() as bwd_syncs:
            (y_TD * gy_TD).sum().backward()
        out[case, backend, dispatch] = {
            "y": y_TD.detach(),
            "dx": x_TD.grad,
            "dw": w_TK.grad,
            "dw1": experts.gate_up_proj.grad.clone(),
            "dw2": experts.down_proj.grad.clone(),
            "fwd_syncs": dict(fwd_syncs),
            "bwd_syncs": dict(bwd_syncs),
        }
    out["checkpointed"] = _same_under_activation_checkpointing(experts, group, world, rank)
    if world == 4:
        out["fsdp"] = _metadata_survives_fully_shard()
    return _plain(out)


def _same_under_activation_checkpointing(experts, group, world, rank):
    """The layer under non-reentrant activation checkpointing (recomputed in backward) gives identical results."""
    from torch.utils.checkpoint import checkpoint

    from moeshard.ep import _dispatch

    set_ep_dispatch("copies")
    x_TD, ids_TK, w_TK, _ = _problem(world, "random")[rank]
    results = []
    forwards = []
    original = _dispatch._OverlappedExperts.forward

    def counted(*args):
        forwards.append(1)
        return original(*args)

    for use_checkpoint in (False, True):
        experts.zero_grad(set_to_none=True)
        x = x_TD.clone().requires_grad_(True)

        def layer(a):
            return routed_experts(
                a.sin(), ids_TK, w_TK, experts.gate_up_proj, experts.down_proj, num_experts=E, ep_group=group
            )

        forwards.clear()
        _dispatch._OverlappedExperts.forward = staticmethod(counted)
        try:
            y = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
            y.square().sum().backward()
        finally:
            _dispatch._OverlappedExperts.forward = staticmethod(original)
        results.append([y.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()])
    # identical results, and the checkpointed layer ran twice (forward + one recomputation), not once per pass
    return all(torch.equal(a, b) for a, b in zip(*results)) and len(forwards) == 2


def _metadata_survives_fully_shard():
    """EP 2 x ep_fsdp 2: FSDP2 replaces the expert parameters with DTensors; the metadata must not care."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    meshes = build_meshes(ep_size=2, device_type="cpu")
    model = _model()
    apply_ep(model, toy_plan(), meshes.ep)
    experts = model.layers[0].mlp.experts
    group = ep_group(experts)
    fully_shard(experts, mesh=meshes.ep_fsdp, shard_placement_fn=lambda p: Shard(1))
    info = get_ep_info(model)
    p = experts.gate_up_proj
    return {
        "dtensor": isinstance(p, DTensor),
        "local_shape": tuple(p.to_local().shape),
        "same_group": ep_group(experts) is group,
        "meta": info.params["layers.0.mlp.experts.gate_up_proj"],
    }


def _check(results, world):
    full = _model().layers[0].mlp.experts
    w1, w2 = full.gate_up_proj.detach(), full.down_proj.detach()
    El = E // world
    for case in CASES:
        problem = _problem(world, case)
        x_TD = torch.cat([p[0] for p in problem]).requires_grad_(True)
        ids_TK = torch.cat([p[1] for p in problem])
        w_TK = torch.cat([p[2] for p in problem]).requires_grad_(True)
        gy_TD = torch.cat([p[3] for p in problem])
        w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        y_TD = reference_routed_experts(x_TD, ids_TK, w_TK, w1r, w2r)
        (y_TD * gy_TD).sum().backward()
        bounds = torch.tensor([0] + [p[0].shape[0] for p in problem]).cumsum(0).tolist()
        for (r, res), (backend, dispatch) in itertools.product(enumerate(results), VARIANTS):
            got = res[case, backend, dispatch]
            rows = slice(bounds[r], bounds[r + 1])
            experts = slice(r * El, (r + 1) * El)
            for name, a, b in (
                ("y", got["y"], y_TD.detach()[rows]),
                ("dx", got["dx"], x_TD.grad[rows]),
                ("dweights", got["dw"], w_TK.grad[rows]),
                ("dw_gate_up", got["dw1"], w1r.grad[experts]),
                ("dw_down", got["dw2"], w2r.grad[experts]),
            ):
                torch.testing.assert_close(
                    torch.from_numpy(a), b, rtol=1e-5, atol=1e-5, msg=f"{case} {backend} {dispatch} rank {r} {name}"
                )
            # The one documented sync (the split sizes) and nothing in backward.
            assert got["fwd_syncs"] == {"tolist": 1}, (case, r, got["fwd_syncs"])
            assert got["bwd_syncs"] == {}, (case, r, got["bwd_syncs"])
    for r, res in enumerate(results):
        assert res["checkpointed"], f"rank {r}: activation checkpointing changed the results"
        assert res["group_size"] == world
        meta = res["info"].params["layers.0.mlp.experts.down_proj"]
        assert (meta.ep_size, meta.ep_rank, meta.expert_start, meta.expert_end) == (world, r, r * El, (r + 1) * El)


def test_ep2_matches_single_process_reference():
    _check(run_distributed(_ep_layer_body, 2), 2)


def test_ep4_matches_single_process_reference_and_survives_fsdp():
    results = run_distributed(_ep_layer_body, 4, ranks_per_node=4)
    _check(results, 4)
    for r, res in enumerate(results):
        fsdp = res["fsdp"]
        assert fsdp["dtensor"] and fsdp["same_group"], fsdp
        assert fsdp["local_shape"] == (E // 2, F, D)  # [E/ep, 2F/ep_fsdp, D]
        assert (fsdp["meta"].ep_rank, fsdp["meta"].global_shape) == (r % 2, (E, 2 * F, D))
