"""Balancing under sequence parallelism: each rank of a sequence group holds a shard of every row's router logits;
with ``Balancing(sequence_group=...)`` every scope's aux loss and the z-loss equal one process's over the whole rows
(padding included), and the shards' gradients, summed as FSDP sums them, equal the whole rows' (2 gloo ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moeshard.meshes.testing import run_distributed
from moeshard.models.common import Balancing, BalancingOptions, load_balancing_loss
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM

ROWS, SEQ = 3, 8


def _inputs(num_layers: int, num_experts: int):
    gen = torch.Generator().manual_seed(7)
    logits = [torch.randn(ROWS, SEQ, num_experts, generator=gen) for _ in range(num_layers)]
    mask = torch.ones(ROWS, SEQ, dtype=torch.int64)
    mask[1, 5:] = 0  # a padded row, its padding on the second shard only
    return logits, mask


def _term(scope: str, logits_BSE, mask_BS, group):
    torch.manual_seed(0)
    model = ToyForCausalLM(ToyConfig())
    model.init_weights()
    options = BalancingOptions(aux_loss_coef=0.5, scope=scope, z_loss_coef=0.25)
    balancing = Balancing(model, options, device="cpu", group=group, sequence_group=group)
    leaves = [t.clone().requires_grad_(True) for t in logits_BSE]
    flat = [t.reshape(-1, t.shape[-1]) for t in leaves]
    # the model's own aux loss (the micro_batch scope's): its tokens'; under sp a shard's, which the group's replaces
    aux = load_balancing_loss(flat, model.num_experts, model.config.num_experts_per_tok, mask_BS)
    out = SimpleNamespace(aux_loss=aux, router_logits=flat, router_ids=None)
    balancing.start_step(1)
    term = balancing.micro_batch_loss(out, mask_BS, rows=ROWS)
    term.backward()
    return float(term.detach()), [t.grad for t in leaves]


def _shard(scope: str):
    import torch.distributed as dist

    rank, sp = dist.get_rank(), dist.get_world_size()
    logits, mask = _inputs(_moe_layers(), _experts())
    s = SEQ // sp
    window = slice(rank * s, (rank + 1) * s)
    return _term(scope, [t[:, window] for t in logits], mask[:, window].contiguous(), dist.group.WORLD)


def _moe_layers() -> int:
    from moeshard.models.common import routers

    return len(routers(ToyForCausalLM(ToyConfig())))


def _experts() -> int:
    return ToyForCausalLM(ToyConfig()).num_experts


@pytest.mark.parametrize("scope", ["micro_batch", "global_batch", "sequence"])
def test_shards_of_a_sequence_group_count_every_token_once(scope):
    logits, mask = _inputs(_moe_layers(), _experts())
    want, want_grads = _term(scope, logits, mask, None)
    res = run_distributed(_shard, 2, scope)
    s = SEQ // 2
    for rank, (got, grads) in enumerate(res):
        assert got == pytest.approx(want, rel=1e-5)  # every rank: the whole rows' loss
        for g, w in zip(grads, want_grads):
            # each rank's backward gets its group's gradient sum, sp times its share of the whole rows' (FSDP's
            # mean over the sp ranks of the group then gives the whole rows')
            torch.testing.assert_close(g / 2, w[:, rank * s : (rank + 1) * s], rtol=1e-5, atol=1e-7)
