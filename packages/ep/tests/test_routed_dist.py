"""EP over gloo (2 and 4 processes): every strategy against LocalDispatch and the plain reference in one process.

Each rank builds the same global problem from a seed, keeps its own tokens and (through apply_ep) its own
experts, and runs the layer forward and backward through the dispatcher apply_ep installed, for every strategy
and GEMM backend: four models with different options, one process, interleaved. The parent runs the whole
problem in one process (all experts) with LocalDispatch and with the plain reference, and compares outputs,
input and routing-weight gradients and the local expert-weight gradients, in float32.
"""

import collections
import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from moeshard.ep import (
    AllToAllDispatch,
    EPOptions,
    LocalDispatch,
    OverlappedDispatch,
    apply_ep,
    recompute_contexts,
    sum_weight_grads,
)
from moeshard.ep._dispatch import routed_experts
from moeshard.ep._plan import ep_group
from moeshard.ep.testing import ToyMoE, count_host_syncs, reference_routed_experts, toy_plan
from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed

# T tokens, K top-k, D hidden, E experts, F expert width
E, D, F = 8, 16, 8
CASES = ("random", "one_expert", "rank_without_tokens", "skewed")
STRATEGIES = {"overlapped": OverlappedDispatch, "all_to_all": AllToAllDispatch}
GEMMS = ("loop", "grouped_mm")  # grouped_mm runs on CPU at these shapes (16-byte aligned rows)
VARIANTS = tuple(itertools.product(STRATEGIES, GEMMS))


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


def _model(num_layers: int = 1):
    torch.manual_seed(0)
    return ToyMoE(num_layers=num_layers, num_experts=E, hidden=D, width=F)


def _ep_layer_body():
    world, rank = dist.get_world_size(), dist.get_rank()
    meshes = build_meshes(ep_size=world, device_type="cpu")
    experts = {}
    for strategy, gemm in VARIANTS:
        model = _model()
        info = apply_ep(model, toy_plan(), meshes.ep, EPOptions(dispatch=strategy, gemm=gemm))
        experts[strategy, gemm] = model.layers[0].mlp.experts
        assert type(experts[strategy, gemm].dispatch) is STRATEGIES[strategy]
    group = ep_group(experts[VARIANTS[0]])
    out = {"info": info, "group_size": dist.get_world_size(group)}
    for case, variant in itertools.product(CASES, VARIANTS):  # the four models interleaved
        x_TD, ids_TK, w_TK, gy_TD = _problem(world, case)[rank]
        layer = experts[variant]
        x_TD.requires_grad_(True)
        w_TK.requires_grad_(True)
        with count_host_syncs() as fwd_syncs:
            y_TD = layer(x_TD, ids_TK, w_TK)
        with count_host_syncs() as bwd_syncs:
            (y_TD * gy_TD).sum().backward()
        functional = routed_experts(
            x_TD, ids_TK, w_TK, layer.gate_up_proj, layer.down_proj, num_experts=E, ep_group=group,
            options=EPOptions(dispatch=variant[0], gemm=variant[1]),
        )  # fmt: skip
        out[(case, *variant)] = {
            "y": y_TD.detach(),
            "dx": x_TD.grad,
            "dw": w_TK.grad,
            "dw1": layer.gate_up_proj.grad.clone(),
            "dw2": layer.down_proj.grad.clone(),
            "functional_same": torch.equal(functional, y_TD),
            "fwd_syncs": dict(fwd_syncs),
            "bwd_syncs": dict(bwd_syncs),
        }
        layer.zero_grad(set_to_none=True)
    for strategy in STRATEGIES:
        out["checkpointed", strategy] = _same_under_activation_checkpointing(experts[strategy, "loop"], world, rank)
        out["hooks", strategy] = _host_sync_hooks(meshes, strategy)
        out["recompute", strategy] = _same_with_recompute(meshes, strategy, world, rank)
        out["taken", strategy] = _taken_as_factors(meshes, strategy, world, rank)
    if world == 4:
        out["fsdp"] = _metadata_survives_fully_shard()
    return out


def _same_under_activation_checkpointing(experts, world, rank):
    """The layer under non-reentrant activation checkpointing (recomputed in backward) gives identical results;
    with ``recompute_contexts`` the recompute replays the forward's route, received counts and exchange sizes: no
    second route, host sync or counts exchange; with ``discard_outputs`` it runs no down projection, no combine and no exchange of
    the outputs back."""
    from torch.utils.checkpoint import checkpoint

    from moeshard.ep._dispatch import overlapped
    from moeshard.ep._expert_pass import ExpertPass

    x_TD, ids_TK, w_TK, _ = _problem(world, "random")[rank]
    results, forwards, syncs, backward_work = [], [], [], []
    original, down, kernels = overlapped._OverlappedExperts.forward, ExpertPass._down, experts.dispatch.kernels
    exchanges = {name: getattr(dist, name) for name in ("all_to_all_single", "batch_isend_irecv")}
    work = collections.Counter()

    def counting(name, fn):
        def run(*args, **kwargs):
            work[name] += 1
            return fn(*args, **kwargs)

        return run

    def counted(*args):
        forwards.append(1)
        return original(*args)

    modes = ("none", "checkpoint", "checkpoint_replay", "checkpoint_discard")
    for mode in modes:
        experts.zero_grad(set_to_none=True)
        x = x_TD.clone().requires_grad_(True)

        def layer(a):
            return experts(a.sin(), ids_TK, w_TK)

        forwards.clear()
        overlapped._OverlappedExperts.forward = staticmethod(counted)
        ExpertPass._down = counting("down", down)
        experts.dispatch.kernels = dataclasses.replace(
            kernels, gather_sum=counting("gather_sum", kernels.gather_sum), route=counting("route", kernels.route)
        )
        for name, fn in exchanges.items():
            setattr(dist, name, counting("exchange", fn))
        try:
            with count_host_syncs() as counts:
                if mode == "none":
                    y = layer(x)
                else:
                    replay = functools.partial(recompute_contexts, [experts.dispatch])
                    if mode == "checkpoint_discard":
                        replay = functools.partial(replay, discard_outputs=True)
                    context = {"context_fn": replay} if mode != "checkpoint" else {}
                    y = checkpoint(layer, x, use_reentrant=False, **context)
                work.clear()
                y.square().sum().backward()
                backward_work.append(dict(work))
        finally:
            overlapped._OverlappedExperts.forward = staticmethod(original)
            ExpertPass._down = down
            experts.dispatch.kernels = kernels
            for name, fn in exchanges.items():
                setattr(dist, name, fn)
        syncs.append(counts["tolist"])
        results.append([y.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()])
    same = all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    # the overlapped layer ran twice when checkpointed (forward + one recomputation), not once per pass
    ran = len(forwards) == (2 if isinstance(experts.dispatch, OverlappedDispatch) else 0)
    # the replaying recompute routes nothing (the forward's order is replayed) and exchanges no counts (one exchange
    # less than the plain one); the one that discards its outputs runs no down projection, one gather-sum (the row
    # expansion's backward, not the combine) and one exchange less again (the outputs' way back)
    work = dict(zip(modes, backward_work))
    plain, full, discard = work["checkpoint"], work["checkpoint_replay"], work["checkpoint_discard"]
    left_out = (
        plain.get("route") == 1
        and "route" not in full
        and "route" not in discard
        and full.get("down", 0) > 0
        and "down" not in discard
        and (full["gather_sum"], discard["gather_sum"]) == (2, 1)
        and full["exchange"] == plain["exchange"] - 1
        and discard["exchange"] == full["exchange"] - 1
    )
    # one exchange-size sync per forward; the plain recompute syncs again, the replaying ones do not
    return same and ran and left_out and syncs == [1, 2, 1, 1]


def _same_with_recompute(meshes, strategy, world, rank):
    """EPOptions.recompute (the expert MLP's intermediates recomputed in backward) changes no bit of the outputs
    or gradients, with either GEMM, and adds no host sync or exchange in backward."""
    x_TD, ids_TK, w_TK, gy_TD = _problem(world, "skewed")[rank]
    results = {}
    for gemm, recompute in itertools.product(GEMMS, ("none", "activation", "mlp")):
        model = _model()
        apply_ep(model, toy_plan(), meshes.ep, EPOptions(dispatch=strategy, gemm=gemm, recompute=recompute))
        layer = model.layers[0].mlp.experts
        x, w = x_TD.clone().requires_grad_(True), w_TK.clone().requires_grad_(True)
        y = layer(x, ids_TK, w)
        with count_host_syncs() as bwd_syncs:
            (y * gy_TD).sum().backward()
        results[gemm, recompute] = [y.detach(), x.grad, w.grad, layer.gate_up_proj.grad, layer.down_proj.grad]
        if dict(bwd_syncs):
            return False
    return all(
        torch.equal(a, b) for (gemm, recompute), got in results.items() for a, b in zip(results[gemm, "none"], got)
    )


class _Keeper:
    """A weight-gradient target that takes the factors it is offered where ``pattern`` (cycled over the offers) says
    so and forms them at the end with ``sum_weight_grads``; otherwise its buffer is the gradient so far. An empty
    pattern: it wants no factors (``wants_factors``)."""

    def __init__(self, layer, pattern):
        self.params, self.pattern, self.offers = (layer.gate_up_proj, layer.down_proj), itertools.cycle(pattern), 0
        self.kept, self.wanted = ([], []), bool(pattern)

    def wants_factors(self):
        return self.wanted

    def _index(self, weight):
        return next((i for i, p in enumerate(self.params) if weight is p), None)

    def __call__(self, weight):
        i = self._index(weight)
        return None if i is None else self.params[i].grad

    def take(self, weight, factors):
        i = self._index(weight)
        if i is None:
            return False
        self.offers += 1
        if next(self.pattern):
            assert factors.offsets.numel() == self.params[i].shape[0]  # over all local experts, halves too
            self.kept[i].append(factors)
            return True
        return False

    def form(self):
        for p, kept in zip(self.params, self.kept):
            if kept:
                formed = sum_weight_grads(kept)
                p.grad = formed if p.grad is None else p.grad + formed


def _taken_as_factors(meshes, strategy, world, rank):
    """Two backwards through the dispatcher with a target that takes all, some or none of the factors offered: the
    gradients formed from what it kept, added to what came back, equal autograd's (float32 rounding); the
    overlapped strategy offers each weight's gradient in its three passes (the own copies' halves, the received
    copies), the plain one in one; also where backward recomputes the expert MLP's intermediates (``recompute``),
    and, for the overlapped strategy with grouped_mm, where the kernel tier forms the passes' gradients together
    (``Kernels.sums_parts``, the triton tier on CUDA; here forced on, with the CPU's ``weight_grad_sum``).
    Returns ``{(case, gemm, recompute, together, pattern): (max error, offers per weight and backward)}``."""
    out, unformed = {}, {}
    together = (False, True) if strategy == "overlapped" else (False,)
    for case, gemm, recompute, parts in itertools.product(CASES, GEMMS, ("none", "mlp"), together):
        if parts and gemm != "grouped_mm":
            continue
        x_TD, ids_TK, w_TK, gy_TD = _problem(world, case)[rank]
        grads = {}
        for pattern in (None, (True,), (False, True, True), (False,), ()):  # a cycle of 3: one weight's parts both ways
            model = _model()
            apply_ep(model, toy_plan(), meshes.ep, EPOptions(dispatch=strategy, gemm=gemm, recompute=recompute))
            layer = model.layers[0].mlp.experts
            sums = []  # parts per weight_grad_sum call
            if parts:
                tier = layer.dispatch.kernels

                def summed(kept, out, accumulate, squares=None, tier=tier, sums=sums):
                    sums.append(len(kept))
                    tier.weight_grad_sum(kept, out, accumulate, squares)

                layer.dispatch.kernels = dataclasses.replace(tier, sums_parts=lambda a: True, weight_grad_sum=summed)
            keeper = None if pattern is None else _Keeper(layer, pattern)
            layer.dispatch.accumulate_weight_grads(keeper)
            for _ in range(2):
                (layer(x_TD, ids_TK, w_TK) * gy_TD).sum().backward()
            sums = list(sums)  # those of backward (not the keeper's forming)
            if keeper is not None:
                keeper.form()
            grads[pattern] = (layer.gate_up_proj.grad, layer.down_proj.grad)
            if pattern is None and parts:  # the passes formed together, against autograd's sum of each pass's
                reference = unformed[case, gemm, recompute]
                err = max((a - b).abs().max().item() for a, b in zip(grads[None], reference, strict=True))
                out[case, gemm, recompute, parts, None] = (err, 3, sums)
                grads[None] = reference
            elif pattern is None:
                unformed[case, gemm, recompute] = grads[None]
            else:
                err = max((a - b).abs().max().item() for a, b in zip(grads[pattern], grads[None], strict=True))
                out[case, gemm, recompute, parts, pattern] = (err, keeper.offers / 4, sums)
    return out


def _host_sync_hooks(meshes, strategy):
    """EPInfo.add_host_sync_hook: once per EP layer per forward, none in backward, gone after remove(), per model."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, other = _model(num_layers=3), _model(num_layers=2)
    info = apply_ep(model, toy_plan(), meshes.ep, EPOptions(dispatch=strategy))
    apply_ep(other, toy_plan(), meshes.ep, EPOptions(dispatch=strategy))
    calls = []
    first = info.add_host_sync_hook(lambda: calls.append("first"))
    info.add_host_sync_hook(lambda: calls.append("second"))
    x_TD = _problem(world, "random")[rank][0]
    counts = []
    y = model(x_TD)
    counts.append(list(calls))  # 3 layers, both hooks each, in the order they were added
    y.sum().backward()
    other(x_TD)  # another model's dispatchers run other hooks
    counts.append(len(calls))
    first.remove()
    model(x_TD)
    counts.append(calls[6:])
    return counts


def _metadata_survives_fully_shard():
    """EP 2 x ep_fsdp 2: FSDP2 replaces the expert parameters with DTensors; the metadata must not care."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    meshes = build_meshes(ep_size=2, device_type="cpu")
    model = _model()
    info = apply_ep(model, toy_plan(), meshes.ep)
    experts = model.layers[0].mlp.experts
    group = ep_group(experts)
    dispatch = experts.dispatch
    fully_shard(experts, mesh=meshes.ep_fsdp, shard_placement_fn=lambda p: Shard(1))
    p = experts.gate_up_proj
    return {
        "dtensor": isinstance(p, DTensor),
        "local_shape": tuple(p.to_local().shape),
        "same_group": ep_group(experts) is group,
        "same_dispatch": experts.dispatch is dispatch,
        "meta": info.params["layers.0.mlp.experts.gate_up_proj"],
    }


def _check(results, world):
    full = _model().layers[0].mlp.experts
    w1, w2 = full.gate_up_proj.detach(), full.down_proj.detach()
    El = E // world
    for case in CASES:
        problem = _problem(world, case)
        ids_TK = torch.cat([p[1] for p in problem])
        gy_TD = torch.cat([p[3] for p in problem])
        want = {}
        for name, fn in [("reference", reference_routed_experts)] + [
            (gemm, LocalDispatch(E, EPOptions(gemm=gemm))) for gemm in GEMMS
        ]:
            x_TD = torch.cat([p[0] for p in problem]).requires_grad_(True)
            w_TK = torch.cat([p[2] for p in problem]).requires_grad_(True)
            w1r, w2r = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
            y_TD = fn(x_TD, ids_TK, w_TK, w1r, w2r)
            (y_TD * gy_TD).sum().backward()
            want[name] = (y_TD.detach(), x_TD.grad, w_TK.grad, w1r.grad, w2r.grad)
        bounds = torch.tensor([0] + [p[0].shape[0] for p in problem]).cumsum(0).tolist()
        for (r, res), (strategy, gemm) in itertools.product(enumerate(results), VARIANTS):
            got = res[case, strategy, gemm]
            rows = slice(bounds[r], bounds[r + 1])
            experts = slice(r * El, (r + 1) * El)
            for ref in ("reference", gemm):
                y, dx, dw, dw1, dw2 = want[ref]
                for name, a, b in (
                    ("y", got["y"], y[rows]),
                    ("dx", got["dx"], dx[rows]),
                    ("dweights", got["dw"], dw[rows]),
                    ("dw_gate_up", got["dw1"], dw1[experts]),
                    ("dw_down", got["dw2"], dw2[experts]),
                ):
                    torch.testing.assert_close(
                        a, b, rtol=1e-5, atol=1e-5, msg=f"{case} {strategy} {gemm} rank {r} {name} vs {ref}"
                    )
            assert got["functional_same"], (case, strategy, gemm, r)
            # The one documented sync (the split sizes) and nothing in backward.
            assert got["fwd_syncs"] == {"tolist": 1}, (case, strategy, gemm, r, got["fwd_syncs"])
            assert got["bwd_syncs"] == {}, (case, strategy, gemm, r, got["bwd_syncs"])
    for r, res in enumerate(results):
        assert res["group_size"] == world
        meta = res["info"].params["layers.0.mlp.experts.down_proj"]
        assert (meta.ep_size, meta.ep_rank, meta.expert_start, meta.expert_end) == (world, r, r * El, (r + 1) * El)
        for strategy in STRATEGIES:
            assert res["checkpointed", strategy], f"rank {r} {strategy}: activation checkpointing changed the results"
            assert res["recompute", strategy], f"rank {r} {strategy}: EPOptions.recompute changed the results"
            taken = res["taken", strategy]
            assert any(key[3] for key in taken) == (strategy == "overlapped"), strategy
            for (case, gemm, recompute, parts, pattern), (err, offers, sums) in taken.items():
                what = (r, strategy, case, gemm, recompute, parts, pattern)
                assert err <= 1e-5, (*what, err)
                assert offers == (0 if pattern == () else 3 if strategy == "overlapped" else 1), (*what, offers)
                # formed together: per backward and weight one sum of the parts the target did not take
                want = {(True,): [], (False, True, True): [1] * 4}.get(pattern, [3] * 4) if parts else []
                assert sums == want, (*what, sums)
            forward, after_backward_and_other_model, after_remove = res["hooks", strategy]
            assert forward == ["first", "second"] * 3, (strategy, forward)
            assert after_backward_and_other_model == 6, strategy
            assert after_remove == ["second"] * 3, (strategy, after_remove)


def test_ep2_matches_local_dispatch_and_reference():
    _check(run_distributed(_ep_layer_body, 2), 2)


def test_ep4_matches_local_dispatch_and_reference_and_survives_fsdp():
    results = run_distributed(_ep_layer_body, 4, ranks_per_node=4)
    _check(results, 4)
    for r, res in enumerate(results):
        fsdp = res["fsdp"]
        assert fsdp["dtensor"] and fsdp["same_group"] and fsdp["same_dispatch"], fsdp
        assert fsdp["local_shape"] == (E // 2, F, D)  # [E/ep, 2F/ep_fsdp, D]
        assert (fsdp["meta"].ep_rank, fsdp["meta"].global_shape) == (r % 2, (E, 2 * F, D))
