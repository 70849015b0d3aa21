"""EP size 1 (no process group): LocalDispatch, routed_experts and grouped_expert_mlp against the plain reference."""

import pytest
import torch

from moeshard.ep import EPOptions, LocalDispatch
from moeshard.ep._dispatch import routed_experts
from moeshard.ep._expert_pass import ExpertPass
from moeshard.ep._kernels import kernels_for
from moeshard.ep._mlp import grouped_expert_mlp
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


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", ["random", "skewed", "empty"])
def test_ep1_matches_reference(gemm, case):
    T = 0 if case == "empty" else 12
    x, ids, w_TK, w1, w2 = _problem(T=T, skew=case == "skewed")
    dispatch = LocalDispatch(4, EPOptions(gemm=gemm))
    got = _grads(lambda *a: dispatch(*a[:5]), x, w_TK, w1, w2, ids)
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
    for gemm in ("loop", "grouped_mm"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        y = grouped_expert_mlp(leaves[0], torch.tensor(counts), leaves[1], leaves[2], gemm=gemm)
        y.float().pow(2).sum().backward()
        outs[gemm] = [y.detach().float()] + [t.grad.float() for t in leaves]
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
    routed_experts(x, ids, w_TK, w1, w2, num_experts=4, options=EPOptions(gemm="loop")).sum().backward()
    assert w1.grad is not None and w1.grad[1].abs().sum() == 0 and w1.grad[0].abs().sum() > 0


def test_bad_arguments():
    x, ids, w_TK, w1, w2 = _problem()
    with pytest.raises(ValueError, match="hold 4 of 8 experts but this layer has no EP group"):
        routed_experts(x, ids, w_TK, w1, w2, num_experts=8)
    with pytest.raises(ValueError, match="activation 'relu' is not supported"):
        routed_experts(x, ids, w_TK, w1, w2, num_experts=4, activation="relu")
    with pytest.raises(ValueError, match="integer"):
        routed_experts(x, ids.float(), w_TK, w1, w2, num_experts=4)
    with pytest.raises(ValueError, match=r"topk_ids \[T, K\] and topk_weights \[T, K\]"):
        routed_experts(x, ids, w_TK[:, :1], w1, w2, num_experts=4)
    with pytest.raises(ValueError, match="topk_ids has 11 rows for 12 tokens"):
        routed_experts(x, ids[:11], w_TK[:11], w1, w2, num_experts=4)
    with pytest.raises(ValueError, match="options must be an EPOptions"):
        routed_experts(x, ids, w_TK, w1, w2, num_experts=4, options={"gemm": "loop"})
    with pytest.raises(ValueError, match="expert gemm 'cutlass' is not one of"):
        grouped_expert_mlp(x, torch.tensor([12, 0, 0, 0]), w1, w2, gemm="cutlass")
    with pytest.raises(ValueError, match="kernel tier 'fast' is not one of"):
        grouped_expert_mlp(x, torch.tensor([12, 0, 0, 0]), w1, w2, kernels="fast")
    with pytest.raises(ValueError, match="5 entries for 4 local experts"):
        grouped_expert_mlp(x, [12, 0, 0, 0, 0], w1, w2)
    with pytest.raises(ValueError, match="sums to 11 but x has 12 rows"):
        grouped_expert_mlp(x, [11, 0, 0, 0], w1, w2, gemm="loop")
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        LocalDispatch(0)


def test_sliced_weights_without_ep_are_refused():
    # a layer holding some experts only (EP-sliced, or loaded with an expert range) needs the EP dispatch
    x, ids, w_TK, w1, w2 = _problem()
    with pytest.raises(ValueError, match="hold 2 of 4 experts but this layer has no EP group.*apply_ep"):
        LocalDispatch(4)(x, ids, w_TK, w1[:2], w2[:2])


def test_functional_form_is_the_dispatcher():
    x, ids, w_TK, w1, w2 = _problem()
    for options in (EPOptions(gemm="loop"), EPOptions(gemm="grouped_mm", dispatch="all_to_all")):
        a = routed_experts(x, ids, w_TK, w1, w2, num_experts=4, options=options)
        b = LocalDispatch(4, options)(x, ids, w_TK, w1, w2)
        assert torch.equal(a, b)


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("weighted", [False, True])
def test_expert_pass_backward_equals_autograd(gemm, activation, weighted):
    """The hand-written expert-MLP backward (used by every strategy) is autograd's through the plain ops, with and
    without routing weights applied to the rows (their gradient included)."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 3, 8]  # an expert without rows too
    x = torch.randn(sum(counts), 16, generator=g)
    w1 = torch.randn(4, 16, 16, generator=g) / 4
    w2 = torch.randn(4, 16, 8, generator=g) / 3
    s = torch.rand(sum(counts), generator=g) if weighted else None
    gy = torch.randn(sum(counts), 16, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
    s_leaf = None if s is None else s.clone().requires_grad_(True)
    y_ref = _autograd_mlp(*leaves, counts, activation, s_leaf)
    y_ref.backward(gy)
    run = ExpertPass(torch.tensor(counts), counts, activation, gemm, kernels_for("eager"))
    y, saved = run.forward(x, w1, w2, s)
    gx, gw1, gw2, gs, gb, gd = run.backward(gy, saved, w1, w2, need_x=True, need_w=True)
    assert gb == (None, None) and gd == (None, None)  # no biases, no deltas: none of their gradients
    torch.testing.assert_close(y, y_ref.detach(), rtol=1e-6, atol=1e-6)
    for got, leaf in zip((gx, gw1, gw2), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)
    if weighted:
        torch.testing.assert_close(gs, s_leaf.grad, rtol=1e-5, atol=1e-6)
    else:
        assert gs is None
    # grouped_expert_mlp is the same pass under autograd
    leaves2 = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
    s2 = None if s is None else s.clone().requires_grad_(True)
    y2 = grouped_expert_mlp(
        leaves2[0], torch.tensor(counts), *leaves2[1:], activation=activation, gemm=gemm, row_weights=s2
    )
    y2.backward(gy)
    assert torch.equal(y2.detach(), y)
    for got, leaf in zip((gx, gw1, gw2), leaves2):
        assert torch.equal(got, leaf.grad)
    assert s2 is None or torch.equal(gs, s2.grad)


def _autograd_mlp(x, w1, w2, counts, activation, s=None):
    from moeshard.ep._kernels import ACTIVATIONS

    outs, start = [], 0
    for e, n in enumerate(counts):
        gate, up = (x[start : start + n] @ w1[e].T).chunk(2, dim=-1)
        a = ACTIVATIONS[activation](gate) * up
        outs.append((a if s is None else a * s[start : start + n, None]) @ w2[e].T)
        start += n
    return torch.cat(outs)


def test_weight_gradients_only_where_asked():
    x, ids, w_TK, w1, w2 = _problem()
    counts = [3, 3, 3, 3]
    xr, w1r = x.clone().requires_grad_(True), w1.clone().requires_grad_(True)
    grouped_expert_mlp(xr, counts, w1r, w2, gemm="loop").sum().backward()  # w2 is not a leaf that wants grad
    assert xr.grad is not None and w1r.grad is not None and w2.grad is None


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recompute_is_bit_identical_and_saves_less(gemm, dtype):
    """EPOptions.recompute: the same outputs and gradients bit for bit, and only what it says stays saved
    (x; x and the gate/up output; or all three), counted with saved-tensor hooks over a whole routed layer: the
    expert outputs are never kept (the routing weights' gradient comes from the activation)."""
    x, ids, w_TK, w1, w2 = _problem(T=16, K=2, D=24, E=4, F=8, dtype=dtype)
    got, saved = {}, {}
    for recompute in ("none", "activation", "mlp"):
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append((t.shape, t.data_ptr()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            options = EPOptions(gemm=gemm, recompute=recompute)
            got[recompute] = _grads(LocalDispatch(4, options), x, w_TK, w1, w2, ids)
        # the distinct saved [N, width] tensors of the N = T*K routed copies (D = 24, 2F = 16, F = 8)
        saved[recompute] = sorted({(s[-1], p) for s, p in sizes if len(s) == 2 and s[0] == 32})
    for recompute in ("activation", "mlp"):
        for a, b in zip(got["none"], got[recompute]):
            assert torch.equal(a, b), recompute
    widths = {r: [w for w, _ in saved[r]] for r in saved}
    # x [N, D]; the gate/up output h [N, 2F]; the gated activation a [N, F]
    assert widths["none"] == [8, 16, 24], widths
    assert widths["activation"] == [16, 24], widths
    assert widths["mlp"] == [24], widths


def test_recompute_is_validated():
    with pytest.raises(ValueError, match="recompute='gate' is not one of"):
        EPOptions(recompute="gate")
    x, ids, w_TK, w1, w2 = _problem()
    with pytest.raises(ValueError, match="recompute='all' is not one of"):
        grouped_expert_mlp(x, [3, 3, 3, 3], w1, w2, recompute="all")
