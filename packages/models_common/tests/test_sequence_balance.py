"""The ``sequence`` balancing scope (DeepSeek-V3's complementary sequence-wise balance loss) against a direct loop
over rows and tokens, for both router kinds: value and gradient w.r.t. the router logits, with padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from moeshard.models.common import Balancing, BalancingOptions, GroupLimitedRouter, TopKRouter

B, S, E, K, LAYERS = 3, 5, 8, 2, 2


class _Routers(nn.Module):
    """The part of a model :class:`Balancing` reads: its routers, in layer order, and ``config.num_experts_per_tok``."""

    def __init__(self, make) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(LAYERS))
        self.config = SimpleNamespace(num_experts_per_tok=K)


def _top_k_router() -> TopKRouter:
    router = TopKRouter(E, 4, K, norm_topk_prob=True)
    router.enable_bias()
    router.bias.copy_(torch.linspace(0.2, -0.2, E))  # shifts the selection, not the affinities
    return router


def _group_limited_router() -> GroupLimitedRouter:
    router = GroupLimitedRouter(E, 4, K, n_group=4, topk_group=2, scoring_func="sigmoid")
    router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.4, E))  # shifts the selection, not the affinities
    return router


def _reference(router, logits_TE: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """One layer's loss, term by term: per row its tokens, their selection and normalised scores, ``Σ_i f_i · P_i``."""
    losses = []
    for b in range(B):
        tokens = [b * S + s for s in range(S) if mask_BS[b, s]]
        if not tokens:
            continue
        f = [0.0] * E
        p = [torch.zeros(())] * E
        for t in tokens:
            row = logits_TE[t].float()
            if isinstance(router, TopKRouter):
                s_E = torch.softmax(row, dim=-1)
                selected = torch.topk(s_E.detach() + router.bias, K).indices.tolist()
            else:
                s_E = torch.sigmoid(row)
                choice = s_E.detach() + router.e_score_correction_bias
                groups = choice.view(router.n_group, -1)
                best = torch.topk(groups.topk(2, dim=-1).values.sum(-1), router.topk_group).indices.tolist()
                allowed = [i for i in range(E) if i // (E // router.n_group) in best]
                selected = sorted(allowed, key=lambda i: -float(choice[i]))[:K]
            for i in selected:
                f[i] += E / (K * len(tokens))
            for i in range(E):
                p[i] = p[i] + s_E[i] / s_E.sum() / len(tokens)
        losses.append(sum(f[i] * p[i] for i in range(E)))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("make", [_top_k_router, _group_limited_router], ids=["top_k", "group_limited"])
def test_sequence_loss_and_its_gradient_match_a_loop_over_rows(make):
    torch.manual_seed(0)
    model = _Routers(make)
    mask_BS = torch.ones(B, S, dtype=torch.long)
    mask_BS[0, 3:] = 0  # a padded row
    mask_BS[2, :] = 0  # a row of padding only: left out of the mean
    logits = [torch.randn(B * S, E, requires_grad=True) for _ in range(LAYERS)]
    coef, micro_batches = 1e-4, 2
    balancing = Balancing(model, BalancingOptions(aux_loss_coef=coef, scope="sequence"), device="cpu")
    balancing.start_step(micro_batches)
    term = balancing.micro_batch_loss(SimpleNamespace(aux_loss=None, router_logits=tuple(logits)), mask_BS)
    (got,) = torch.autograd.grad(term, logits[0])

    ref_logits = [x.detach().clone().requires_grad_(True) for x in logits]
    ref = sum(_reference(r, x, mask_BS) for r, x in zip(model.layers, ref_logits)) / LAYERS
    (want,) = torch.autograd.grad(coef * ref / micro_batches, ref_logits[0])
    torch.testing.assert_close(term, coef * ref / micro_batches, rtol=1e-5, atol=0)
    torch.testing.assert_close(balancing.end_step().aux_loss, ref.detach() / micro_batches, rtol=1e-5, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-12)
    assert got[2 * S :].abs().sum() == 0 and got[3:S].abs().sum() == 0  # padding gets no gradient
    # without a mask, the rows come from rows=; every token then counts
    balancing.start_step(1)
    out = SimpleNamespace(aux_loss=None, router_logits=tuple(x.detach() for x in logits))
    unpadded = balancing.micro_batch_loss(out, rows=B) / coef
    full = sum(_reference(r, x.detach(), torch.ones(B, S)) for r, x in zip(model.layers, logits)) / LAYERS
    torch.testing.assert_close(unpadded, full, rtol=1e-5, atol=0)


def test_sequence_scope_needs_the_rows():
    model = _Routers(_top_k_router)
    balancing = Balancing(model, BalancingOptions(aux_loss_coef=1e-4, scope="sequence"), device="cpu")
    balancing.start_step(1)
    out = SimpleNamespace(aux_loss=None, router_logits=tuple(torch.randn(B * S, E) for _ in range(LAYERS)))
    with pytest.raises(ValueError, match=r"scope='sequence' needs the micro-batch's rows: .*rows=B"):
        balancing.micro_batch_loss(out)
    with pytest.raises(ValueError, match="do not split into 4 rows"):
        balancing.micro_batch_loss(out, rows=4)
    with pytest.raises(ValueError, match="rows=2 but the attention mask has 3 rows"):
        balancing.micro_batch_loss(out, torch.ones(B, S), rows=2)
    # the other scopes need no rows
    other = Balancing(model, BalancingOptions(aux_loss_coef=1e-4, scope="global_batch"), device="cpu")
    other.start_step(1)
    assert other.micro_batch_loss(out) > 0
