"""Low-rank deltas of the expert weights (``LowRankDelta``): every dispatcher and GEMM backend against the reference
with the merged weights ``W_e + s · B_e A_e``, in float32; a frozen base gets no gradient."""

import itertools

import pytest
import torch
import torch.distributed as dist

from moeshard.ep import EPOptions, LocalDispatch, LowRankDelta, make_dispatch
from moeshard.ep.testing import reference_routed_experts
from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed

# T tokens, K top-k, D hidden, E experts, F expert width, r rank
T, K, D, E, F, R = 24, 2, 16, 4, 8, 4
SCALINGS = (0.5, 2.0)


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    ids[:3] = torch.tensor([0, 1])  # expert E-1 gets few rows; some tokens pinned so routing is not uniform
    w = torch.rand(T, K, generator=g).softmax(-1)
    w1 = torch.randn(E, 2 * F, D, generator=g) / D**0.5
    w2 = torch.randn(E, D, F, generator=g) / F**0.5
    A1, B1 = torch.randn(E, R, D, generator=g) / D**0.5, torch.randn(E, 2 * F, R, generator=g) * 0.3
    A2, B2 = torch.randn(E, R, F, generator=g) / F**0.5, torch.randn(E, D, R, generator=g) * 0.3
    gy = torch.randn(T, D, generator=g)
    return x, ids, w, (w1, w2), (A1, B1, A2, B2), gy


def _leaves(*tensors, grad=True):
    return [t.detach().clone().requires_grad_(grad) for t in tensors]


def _reference(x, ids, w, weights, lowrank, gy):
    x, w, w1, w2, *ab = _leaves(x, w, *weights, *lowrank)
    A1, B1, A2, B2 = ab
    m1 = w1 + SCALINGS[0] * torch.bmm(B1, A1)
    m2 = w2 + SCALINGS[1] * torch.bmm(B2, A2)
    y = reference_routed_experts(x, ids, w, m1, m2)
    (y * gy).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "dw1": w1.grad, "dw2": w2.grad,
            **{n: t.grad for n, t in zip(("dA1", "dB1", "dA2", "dB2"), ab)}}  # fmt: skip


def _ours(dispatch, x, ids, w, weights, lowrank, gy, frozen):
    x, w = _leaves(x, w)
    w1, w2 = _leaves(*weights, grad=not frozen)
    ab = _leaves(*lowrank)
    deltas = (LowRankDelta(ab[0], ab[1], SCALINGS[0]), LowRankDelta(ab[2], ab[3], SCALINGS[1]))
    y = dispatch(x, ids, w, w1, w2, deltas=deltas)
    (y * gy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "dw": w.grad, **{n: t.grad for n, t in zip(("dA1", "dB1", "dA2", "dB2"), ab)}}
    if frozen:
        assert w1.grad is None and w2.grad is None  # a frozen base forms no weight gradient
    else:
        out.update(dw1=w1.grad, dw2=w2.grad)
    return out


def _compare(got, ref, tol=1e-5):
    for name, value in got.items():
        torch.testing.assert_close(value, ref[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize(("gemm", "recompute", "frozen"), [
    *itertools.product(("loop", "grouped_mm"), ("none", "activation", "mlp"), (True,)),
    ("loop", "none", False), ("grouped_mm", "activation", False),
])  # fmt: skip
def test_local_dispatch_equals_the_merged_weights(gemm, recompute, frozen):
    problem = _problem()
    dispatch = LocalDispatch(E, EPOptions(gemm=gemm, recompute=recompute))
    got = _ours(dispatch, *problem, frozen=frozen)
    _compare(got, _reference(*problem))


def test_one_delta_alone_and_a_bad_shape_is_one_line():
    x, ids, w, (w1, w2), (A1, B1, A2, B2), _ = _problem()
    y = LocalDispatch(E)(x, ids, w, w1, w2, deltas=(None, LowRankDelta(A2, B2, 1.5)))
    torch.testing.assert_close(y, reference_routed_experts(x, ids, w, w1, w2 + 1.5 * torch.bmm(B2, A2)))
    with pytest.raises(ValueError, match=r"delta of w_gate_up \(4, 16, 16\) must be A \[4, r, 16\]") as e:
        LocalDispatch(E)(x, ids, w, w1, w2, deltas=(LowRankDelta(A2, B2, 1.0), None))
    assert "\n" not in str(e.value)


def _dist_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(ep_size=world, device_type="cpu")
    x, ids, w, weights, lowrank, gy = _problem()
    rows = slice(rank * T // world, (rank + 1) * T // world)  # this rank's tokens
    experts = slice(rank * E // world, (rank + 1) * E // world)  # and experts (EP: dim 0)
    out = {}
    for strategy, gemm in itertools.product(("overlapped", "all_to_all"), ("loop", "grouped_mm")):
        dispatch = make_dispatch(E, meshes.ep.get_group(), EPOptions(dispatch=strategy, gemm=gemm))
        local = [t[experts] for t in weights], [t[experts] for t in lowrank]
        out[strategy, gemm] = _ours(dispatch, x[rows], ids[rows], w[rows], *local, gy[rows], frozen=True)
    dist.barrier()
    return out


def test_every_ep_strategy_equals_the_merged_weights():
    results = run_distributed(_dist_body, 2)
    ref = _reference(*_problem())
    for rank, per_rank in enumerate(results):
        rows, experts = slice(rank * T // 2, (rank + 1) * T // 2), slice(rank * E // 2, (rank + 1) * E // 2)
        assert len(per_rank) == 4  # two strategies x two GEMM backends
        for got in per_rank.values():
            mine = {k: v[rows] if k in ("y", "dx", "dw") else v[experts] for k, v in ref.items()}
            _compare(got, mine)
