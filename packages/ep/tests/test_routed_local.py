"""EP size 1 (no process group): routed_experts and grouped_expert_mlp against the plain reference."""

import pytest
import torch

from moeshard.ep import grouped_expert_mlp, routed_experts
from moeshard.ep.testing import reference_routed_experts

# T tokens, K top-k, D hidden, E experts, F expert width


def _problem(T=12, K=2, D=16, E=4, F=8, skew=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, dtype=dtype)
    if skew:
        ids_TK = torch.zeros(T, K, dtype=torch.int64)
        ids_TK[:, 1:] = E - 1  # two experts only; the others get no tokens
    else:
        ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        ids_TK = ids_TK.long()
    w_TK = torch.rand(T, K, generator=g).softmax(-1).to(dtype)
    w1 = torch.randn(E, 2 * F, D, generator=g, dtype=dtype) / D**0.5
    w2 = torch.randn(E, D, F, generator=g, dtype=dtype) / F**0.5
    return x_TD, ids_TK, w_TK, w1, w2


def _grads(fn, x, w_TK, w1, w2, *rest):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w_TK, w1, w2)]
    y = fn(leaves[0], rest[0], leaves[1], leaves[2], leaves[3], *rest[1:])
    if not y.requires_grad:  # the reference with T = 0 builds no graph
        return [y.detach()] + [torch.zeros_like(t) for t in leaves]
    # A fixed, non-uniform upstream grad so every output element matters.
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", ["random", "skewed", "empty"])
def test_ep1_matches_reference(backend, case):
    T = 0 if case == "empty" else 12
    x, ids, w_TK, w1, w2 = _problem(T=T, skew=case == "skewed")
    got = _grads(lambda *a: routed_experts(*a[:5], num_experts=4, backend=backend), x, w_TK, w1, w2, ids)
    ref = _grads(reference_routed_experts, x, w_TK, w1, w2, ids)
    for name, a, b in zip(["y", "dx", "dweights", "dw_gate_up", "dw_down"], got, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_grouped_mm_and_loop_agree_bf16():
    g = torch.Generator().manual_seed(1)
    E, D, F = 4, 32, 16
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), D, generator=g).bfloat16()
    w1 = (torch.randn(E, 2 * F, D, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).bfloat16()
    outs = {}
    for backend in ("loop", "grouped_mm"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        y = grouped_expert_mlp(leaves[0], torch.tensor(counts), leaves[1], leaves[2], backend=backend)
        y.float().pow(2).sum().backward()
        outs[backend] = [y.detach().float()] + [t.grad.float() for t in leaves]
    for a, b in zip(outs["loop"], outs["grouped_mm"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_no_tokens_still_connects_the_weights():
    # Every rank must produce expert-weight grads (zeros here) or FSDP2 would reduce different sets.
    x, ids, w_TK, w1, w2 = _problem(T=0)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    routed_experts(x, ids, w_TK, w1, w2, num_experts=4).sum().backward()
    assert w1.grad is not None and w2.grad is not None and w1.grad.abs().sum() == 0


def test_expert_without_tokens_gets_zero_grad_not_none():
    x, ids, w_TK, w1, w2 = _problem(skew=True)
    w1.requires_grad_(True)
    routed_experts(x, ids, w_TK, w1, w2, num_experts=4, backend="loop").sum().backward()
    assert w1.grad is not None and w1.grad[1].abs().sum() == 0 and w1.grad[0].abs().sum() > 0


def test_bad_arguments():
    x, ids, w_TK, w1, w2 = _problem()
    with pytest.raises(ValueError, match="num_experts=8 but the EP group of 1 ranks holds 4"):
        routed_experts(x, ids, w_TK, w1, w2, num_experts=8)
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        routed_experts(x, ids, w_TK, w1, w2, num_experts=4, activation="relu")
    with pytest.raises(ValueError, match="integer"):
        routed_experts(x, ids.float(), w_TK, w1, w2, num_experts=4)
    with pytest.raises(ValueError, match="backend must be one of"):
        grouped_expert_mlp(x, torch.tensor([12, 0, 0, 0]), w1, w2, backend="cutlass")
    with pytest.raises(ValueError, match="5 entries for 4 local experts"):
        grouped_expert_mlp(x, [12, 0, 0, 0, 0], w1, w2)
    with pytest.raises(ValueError, match="sums to 11 but x has 12 rows"):
        grouped_expert_mlp(x, [11, 0, 0, 0], w1, w2, backend="loop")


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_expert_pass_backward_equals_autograd(backend, activation):
    """The hand-written expert-MLP backward (used by the overlapped EP dispatch) is autograd's, both backends."""
    from moeshard.ep._grouped import ExpertPass

    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 3, 8]  # an expert without rows too
    x = torch.randn(sum(counts), 16, generator=g)
    w1 = torch.randn(4, 16, 16, generator=g) / 4
    w2 = torch.randn(4, 16, 8, generator=g) / 3
    gy = torch.randn(sum(counts), 16, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
    y_ref = grouped_expert_mlp(*leaves[:1], torch.tensor(counts), *leaves[1:], activation=activation, backend=backend)
    y_ref.backward(gy)
    run = ExpertPass(torch.tensor(counts), counts, activation, backend)
    y, saved = run.forward(x, w1, w2)
    gx, gw1, gw2 = run.backward(gy, saved, w1, w2, need_x=True, need_w=True)
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-6, atol=1e-6)
    for got, leaf in zip((gx, gw1, gw2), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)
