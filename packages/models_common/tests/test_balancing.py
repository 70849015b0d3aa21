"""Expert balancing pieces: the routers' selection bias, expert counts, the loss over a larger batch's
frequencies, the z-loss and the aux-loss-free bias update (no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeshard.models.common import (
    Balancing,
    BalancingOptions,
    GlobalExpertCounts,
    TopKRouter,
    expert_counts,
    global_balancing_loss,
    load_balancing_loss,
    router_z_loss,
    routers,
    update_router_bias,
)
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = ToyForCausalLM(ToyConfig())
    m.init_weights()
    return m


def test_zero_bias_routes_as_before_and_a_bias_changes_selection_not_weights():
    torch.manual_seed(0)
    c = ToyConfig()
    router = TopKRouter(c.pool, c.hidden_size, c.num_experts_per_tok, True)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(32, router.weight.shape[1])
    logits, w0, ids0 = router(x)
    router.enable_bias()
    assert "bias" in router.state_dict()
    _, w1, ids1 = router(x)
    assert torch.equal(ids0, ids1) and torch.equal(w0, w1)
    router.bias[3] = 10.0  # expert 3 wins every token's selection
    _, w2, ids2 = router(x)
    assert (ids2 == 3).any(-1).all()
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    picked = probs.gather(-1, ids2)
    torch.testing.assert_close(w2, (picked / picked.sum(-1, keepdim=True)).to(w2.dtype))  # unbiased weights


def test_counts_follow_the_selection(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(ids, output_router_logits=True)
    k, e = model.config.num_experts_per_tok, model.config.pool
    counts = expert_counts(out.router_logits, k)
    assert counts.shape == (2, e) and torch.equal(counts.sum(-1), torch.full((2,), 24.0 * k))
    mask = torch.ones(2, 12)
    mask[1, 6:] = 0
    assert torch.equal(expert_counts(out.router_logits, k, attention_mask_BS=mask).sum(-1), torch.full((2,), 18.0 * k))
    # the model hands on the selection that routed the tokens: counted as it is, the same counts in one scatter
    assert [t.shape for t in out.router_ids] == [(24, k)] * 2
    for m in (None, mask):
        handed = expert_counts(out.router_logits, k, attention_mask_BS=m, router_ids=out.router_ids)
        assert torch.equal(handed, expert_counts(out.router_logits, k, attention_mask_BS=m))
    # and that selection, not a new one from the logits, is what the balancing hooks count
    swapped = SimpleNamespace(aux_loss=None, router_logits=out.router_logits, router_ids=out.router_ids[::-1])
    balancing = Balancing(model, BalancingOptions(), device="cpu")
    balancing.start_step(1)
    balancing.micro_batch_loss(swapped)
    assert torch.equal(balancing.end_step().expert_load, counts.flip(0))
    model.enable_router_bias()
    rs = routers(model)
    rs[0].bias[5] = 10.0
    counts_b = expert_counts(out.router_logits, k, [r.bias for r in rs])
    assert counts_b[0, 5] == 24 and torch.equal(counts_b[1], counts[1])


def test_global_loss_with_own_counts_uniform_counts_and_gradient(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(ids, output_router_logits=True)
    k, e = model.config.num_experts_per_tok, model.config.pool
    own = global_balancing_loss(out.router_logits, expert_counts(out.router_logits, k), k)
    # per layer, transformers' formula on that layer alone
    per_layer = torch.stack([load_balancing_loss((lg,), e, k) for lg in out.router_logits]).mean()
    torch.testing.assert_close(own, per_layer)
    uniform = global_balancing_loss(out.router_logits, torch.ones(2, e), k)
    torch.testing.assert_close(uniform, torch.tensor(float(k)))  # E · (K/E) · Σ_e P_e = K
    skewed = torch.zeros(2, e)
    skewed[:, 0] = 1.0
    loss = global_balancing_loss(out.router_logits, skewed, k)
    loss.backward()
    gate = routers(model)[0].weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_z_loss_and_bias_update(model):
    logits = [torch.tensor([[0.0, 0.0], [1.0, -1.0]])]
    want = torch.logsumexp(logits[0], -1).square().mean()
    torch.testing.assert_close(router_z_loss(logits), want)
    with pytest.raises(ValueError, match="enable_router_bias"):
        update_router_bias(model, torch.ones(2, model.config.pool), 0.1)
    model.enable_router_bias()
    load = torch.zeros(2, model.config.pool)
    load[:, 0] = 8.0  # expert 0 over-loaded, the others under
    update_router_bias(model, load, 0.01)
    for r in routers(model):
        assert r.bias[0] == pytest.approx(-0.01) and torch.allclose(r.bias[1:], torch.full_like(r.bias[1:], 0.01))
    with pytest.raises(ValueError, match="MoE layers"):
        update_router_bias(model, torch.ones(3, model.config.pool), 0.1)


def test_global_counts_without_a_process_group():
    counts = GlobalExpertCounts()
    assert counts.total() is None
    a, b = torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0, 0.0]])
    assert torch.equal(counts.add(a, all_reduce=True), a)  # running: micro-batches 1..m
    assert torch.equal(counts.add(b, all_reduce=True), a + b)
    assert torch.equal(counts.total(), a + b)
    counts.reset()
    counts.add(a)
    assert torch.equal(counts.add(b), a + b) and torch.equal(counts.total(), a + b)


def _two_ranks_counts() -> dict:
    import torch.distributed as dist

    r = dist.get_rank()
    mine = [torch.tensor([[1.0 + r, 0.0]]), torch.tensor([[0.0, 10.0 * (r + 1)]])]
    running = GlobalExpertCounts()
    seen = [running.add(c, all_reduce=True).clone() for c in mine]
    local = GlobalExpertCounts()
    before = [local.add(c).clone() for c in mine]
    return {"seen": seen, "total": running.total(), "local": before, "local_total": local.total()}


def test_global_counts_over_two_ranks():
    from moeshard.meshes.testing import run_distributed

    out = run_distributed(_two_ranks_counts, 2)
    for r, res in enumerate(out):
        # micro-batch 1 of both ranks, then micro-batches 1 and 2 of both ranks
        assert torch.equal(res["seen"][0], torch.tensor([[3.0, 0.0]]))
        assert torch.equal(res["seen"][1], torch.tensor([[3.0, 30.0]]))
        assert torch.equal(res["total"], res["seen"][1]) and torch.equal(res["local_total"], res["seen"][1])
        assert torch.equal(res["local"][1], torch.tensor([[1.0 + r, 10.0 * (r + 1)]]))  # this rank's until total()
