"""The expert MLP's spec: the clamped SwiGLU and the experts' biases, through every kernel tier, GEMM backend,
recompute mode and dispatcher (EP 2 over gloo), forward and backward, against a plain autograd reference written as
a reference expert MLP with biases (gate rows first); and all of it with low-rank deltas of the weights too."""

import itertools

import pytest
import torch
import torch.distributed as dist

from moeshard.ep import (
    ClampedSwiGLU,
    EPOptions,
    LocalDispatch,
    LowRankDelta,
    grouped_expert_mlp,
    make_dispatch,
    routed_experts,
)
from moeshard.meshes.testing import run_distributed

# T tokens, K top-k, D hidden, E experts, F expert width, R the deltas' rank
T, K, D, E, F, R = 12, 2, 16, 4, 8, 4  # R: CPU grouped_mm needs 16-byte strides
SPEC = ClampedSwiGLU(alpha=1.702, limit=7.0)
SCALINGS = (0.5, 2.0)


def _problem(seed=0, E=E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.rand(T, E, generator=g).argsort(-1)[:, :K]
    w = torch.rand(T, K, generator=g).softmax(-1)
    # large enough that both clamps cut some values (limit 7)
    w1 = torch.randn(E, 2 * F, D, generator=g) * 1.5
    w2 = torch.randn(E, D, F, generator=g) / F**0.5
    b1 = torch.randn(E, 2 * F, generator=g) * 2
    b2 = torch.randn(E, D, generator=g)
    gy = torch.randn(T, D, generator=g)
    return x, ids, w, w1, w2, b1, b2, gy


def _low_rank(seed=0, E=E):
    """``(A1, B1, A2, B2)``: deltas of ``w_gate_up`` and ``w_down`` large enough to move the clamps' cuts."""
    g = torch.Generator().manual_seed(100 + seed)
    A1, B1 = torch.randn(E, R, D, generator=g) / D**0.5, torch.randn(E, 2 * F, R, generator=g)
    A2, B2 = torch.randn(E, R, F, generator=g) / F**0.5, torch.randn(E, D, R, generator=g) * 0.3
    return A1, B1, A2, B2


def _reference(x, ids, w, w1, w2, b1, b2, spec=SPEC, lowrank=None):
    """The biased clamped expert MLP, token by token: ``(x W1ᵀ + b1)`` → clamped SwiGLU → ``W2 + b2``, times
    the routing weight; with ``lowrank = (A1, B1, A2, B2)`` each expert's weights are ``W + s · B A``."""
    out = torch.zeros_like(x)
    for t, k in itertools.product(range(x.shape[0]), range(ids.shape[1])):
        e = int(ids[t, k])
        m1, m2 = w1[e], w2[e]
        if lowrank is not None:
            A1, B1, A2, B2 = lowrank
            m1, m2 = m1 + SCALINGS[0] * B1[e] @ A1[e], m2 + SCALINGS[1] * B2[e] @ A2[e]
        h = m1 @ x[t] + (0 if b1 is None else b1[e])
        gate, up = h[:F].clamp(max=spec.limit), h[F:].clamp(-spec.limit, spec.limit)
        a = (up + 1) * gate * torch.sigmoid(gate * spec.alpha)
        out[t] = out[t] + (m2 @ a + (0 if b2 is None else b2[e])) * w[t, k]
    return out


def _grads(fn, tensors, gy):
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves)
    (y * gy).sum().backward()
    return [y.detach()] + [None if t is None else t.grad for t in leaves if t is not None and t.dtype.is_floating_point]


@pytest.mark.parametrize("kernels", ["eager", "compiled", "triton"])
@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
def test_biased_clamped_experts_equal_the_reference(kernels, gemm):
    x, ids, w, w1, w2, b1, b2, gy = _problem()
    want = _grads(lambda x, w, w1, w2, b1, b2: _reference(x, ids, w, w1, w2, b1, b2), (x, w, w1, w2, b1, b2), gy)
    dispatch = LocalDispatch(E, EPOptions(kernels=kernels, gemm=gemm))
    got = _grads(
        lambda x, w, w1, w2, b1, b2: dispatch(x, ids, w, w1, w2, activation=SPEC, biases=(b1, b2)),
        (x, w, w1, w2, b1, b2),
        gy,
    )
    names = ("y", "dx", "dweights", "dw_gate_up", "dw_down", "db_gate_up", "db_down")
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{kernels} {gemm} {name}")


@pytest.mark.parametrize("recompute", ["activation", "mlp"])
def test_recompute_keeps_the_biases(recompute):
    x, ids, w, w1, w2, b1, b2, gy = _problem(seed=1)

    def run(opts):
        d = LocalDispatch(E, opts)
        return _grads(lambda *t: d(t[0], ids, t[1], t[2], t[3], activation=SPEC, biases=(t[4], t[5])),
                      (x, w, w1, w2, b1, b2), gy)  # fmt: skip

    # grouped_mm: the loop backend recomputes per expert, where CPU vector tails may round the sigmoid otherwise
    for a, b in zip(run(EPOptions(gemm="grouped_mm", recompute=recompute)), run(EPOptions(gemm="grouped_mm"))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
def test_biases_spec_and_low_rank_deltas_together(gemm, frozen):
    """Biases, the clamped SwiGLU and a low-rank delta of each weight in one pass equal the per-token reference with
    the merged weights: output, and the gradients of the rows, routing weights, biases, A and B (and of the base
    weights, or none where they are frozen)."""
    x, ids, w, w1, w2, b1, b2, gy = _problem(seed=4)
    lowrank = _low_rank(seed=4)
    want = _grads(lambda x, w, w1, w2, b1, b2, *ab: _reference(x, ids, w, w1, w2, b1, b2, lowrank=ab),
                  (x, w, w1, w2, b1, b2, *lowrank), gy)  # fmt: skip
    x_, w_, b1_, b2_, *ab = (t.clone().requires_grad_(True) for t in (x, w, b1, b2, *lowrank))
    w1_, w2_ = (t.clone().requires_grad_(not frozen) for t in (w1, w2))
    deltas = (LowRankDelta(ab[0], ab[1], SCALINGS[0]), LowRankDelta(ab[2], ab[3], SCALINGS[1]))
    y = LocalDispatch(E, EPOptions(gemm=gemm))(x_, ids, w_, w1_, w2_, activation=SPEC, biases=(b1_, b2_), deltas=deltas)
    (y * gy).sum().backward()
    got = {"y": y.detach(), "dx": x_.grad, "dweights": w_.grad, "dw_gate_up": w1_.grad, "dw_down": w2_.grad,
           "db_gate_up": b1_.grad, "db_down": b2_.grad, **dict(zip(("dA1", "dB1", "dA2", "dB2"), (t.grad for t in ab)))}  # fmt: skip
    names = ("y", "dx", "dweights", "dw_gate_up", "dw_down", "db_gate_up", "db_down", "dA1", "dB1", "dA2", "dB2")
    assert len(want) == len(names)
    for name, b in zip(names, want):
        if frozen and name in ("dw_gate_up", "dw_down"):
            assert got[name] is None, name  # a frozen base forms no weight gradient
            continue
        torch.testing.assert_close(got[name], b, rtol=1e-5, atol=1e-5, msg=f"{gemm} {name}")
    # the clamps cut some values with the deltas applied, so their gradients' zeros are exercised
    h = torch.einsum("nd,nxd->nx", x.repeat_interleave(K, 0), (w1 + SCALINGS[0] * torch.bmm(lowrank[1], lowrank[0]))[ids.reshape(-1)])  # fmt: skip
    assert (h + b1[ids.reshape(-1)]).abs().gt(SPEC.limit).any()


def test_one_bias_or_plain_activation():
    x, ids, w, w1, w2, b1, b2, gy = _problem(seed=2)
    d = LocalDispatch(E, EPOptions(gemm="loop"))
    y = d(x, ids, w, w1, w2, activation=SPEC, biases=(None, b2))
    torch.testing.assert_close(y, _reference(x, ids, w, w1, w2, None, b2), rtol=1e-5, atol=1e-5)
    # without a spec and biases: the very same numbers as before (plain SwiGLU)
    assert torch.equal(d(x, ids, w, w1, w2), d(x, ids, w, w1, w2, activation="silu", biases=(None, None)))


def test_bad_bias_and_spec_are_refused():
    x, ids, w, w1, w2, b1, b2, _ = _problem()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    rows = x.repeat_interleave(K, 0)
    with pytest.raises(ValueError, match=r"gate_up bias must be \[E, 2F\]"):
        grouped_expert_mlp(rows, counts, w1, w2, gemm="loop", activation=SPEC, biases=(b1[:, :F], None))
    with pytest.raises(ValueError, match="alpha > 0 and limit > 0"):
        ClampedSwiGLU(limit=0.0)


def _ep2_body():
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    x, ids, w, w1, w2, b1, b2, gy = _problem(seed=3, E=E)
    mine = slice(rank * T // 2, (rank + 1) * T // 2)
    experts = slice(rank * E // 2, (rank + 1) * E // 2)
    out = {}
    for strategy, gemm in itertools.product(("all_to_all", "overlapped"), ("loop", "grouped_mm")):
        opts = EPOptions(dispatch=strategy, gemm=gemm)
        leaves = [t.clone().requires_grad_(True) for t in (x[mine], w[mine], w1[experts], w2[experts])]
        bl = [t[experts].clone().requires_grad_(True) for t in (b1, b2)]
        y = make_dispatch(E, group, opts)(leaves[0], ids[mine], leaves[1], leaves[2], leaves[3],
                                          activation=SPEC, biases=tuple(bl))  # fmt: skip
        (y * gy[mine]).sum().backward()
        functional = routed_experts(x[mine], ids[mine], w[mine], w1[experts], w2[experts], num_experts=E,
                                    ep_group=group, activation=SPEC, options=opts, biases=(b1[experts], b2[experts]))  # fmt: skip
        out[strategy, gemm] = [y.detach(), *(t.grad for t in leaves), *(b.grad for b in bl), functional.detach()]
        # the same with a low-rank delta of each weight, the base frozen
        x_, w_, *rest = (t.clone().requires_grad_(True) for t in (x[mine], w[mine], b1[experts], b2[experts],
                                                                   *(t[experts] for t in _low_rank(seed=3))))  # fmt: skip
        bl, ab = rest[:2], rest[2:]
        deltas = (LowRankDelta(ab[0], ab[1], SCALINGS[0]), LowRankDelta(ab[2], ab[3], SCALINGS[1]))
        y = make_dispatch(E, group, opts)(x_, ids[mine], w_, w1[experts], w2[experts], activation=SPEC,
                                          biases=tuple(bl), deltas=deltas)  # fmt: skip
        (y * gy[mine]).sum().backward()
        out[strategy, gemm, "lowrank"] = [y.detach(), x_.grad, w_.grad, *(t.grad for t in rest)]
    return out


def test_ep2_dispatchers_equal_the_reference():
    results = run_distributed(_ep2_body, 2)
    x, ids, w, w1, w2, b1, b2, gy = _problem(seed=3, E=E)
    want = _grads(lambda *t: _reference(t[0], ids, *t[1:]), (x, w, w1, w2, b1, b2), gy)
    names = ("y", "dx", "dweights", "dw_gate_up", "dw_down", "db_gate_up", "db_down")
    lowrank = _low_rank(seed=3)
    want_lr = _grads(lambda x, w, b1, b2, *ab: _reference(x, ids, w, w1, w2, b1, b2, lowrank=ab),
                     (x, w, b1, b2, *lowrank), gy)  # fmt: skip
    names_lr = ("y", "dx", "dweights", "db_gate_up", "db_down", "dA1", "dB1", "dA2", "dB2")
    for rank, res in enumerate(results):
        rows, experts = slice(rank * T // 2, (rank + 1) * T // 2), slice(rank * E // 2, (rank + 1) * E // 2)
        for variant, got in res.items():
            if variant[-1] == "lowrank":
                assert len(got) == len(want_lr) == len(names_lr)
                for name, a, b, part in zip(names_lr, got, want_lr, (rows, rows, rows) + (experts,) * 6):
                    torch.testing.assert_close(a, b[part], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {variant} {name}")
                continue
            for name, a, b, part in zip(names, got, want, (rows, rows, rows) + (experts,) * 4):
                torch.testing.assert_close(a, b[part], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {variant} {name}")
            torch.testing.assert_close(got[-1], got[0], rtol=0, atol=0)
