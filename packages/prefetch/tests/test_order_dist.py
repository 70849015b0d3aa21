"""Evidence on 4 gloo processes (2 nodes x 2, EP 2, ep_fsdp 2) with the toy model: the recorded all-gather order
of one real step, with and without the schedule, and the same losses either way.

One spawn serves every test (a module-scoped fixture): each rank builds the model once per depth, trains three
steps, records the second. The same checks on the real Qwen3-MoE (and the host-sync prefetch) are in the
repository's tests/test_prefetch_qwen3moe.py.
"""

import pytest
import torch
import torch.distributed as dist

from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed
from moeshard.prefetch import apply_schedule, build_schedule, stage_units
from moeshard.prefetch.testing import (
    ToyMoE,
    check_default_order,
    check_scheduled_order,
    shard_toy,
    train_and_record,
)

WORLD, RANKS_PER_NODE, EP = 4, 2, 2
DEPTHS = (0, 1, 2)


def _groups(module):
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]


def _toy_body():
    meshes = build_meshes(ep_size=EP, device_type="cpu")
    out = {}
    for depth in DEPTHS:
        model = ToyMoE(num_layers=4, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
        stages = shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)
        schedule = build_schedule(stages, depth=depth)
        apply_schedule(schedule)

        def loss(step, model=model):
            gen = torch.Generator().manual_seed(dist.get_rank())  # the same batch each step: the loss must fall
            tokens = torch.randint(0, 32, (2, 8), generator=gen)
            return model(tokens, torch.roll(tokens, -1, dims=1))

        losses, trace = train_and_record(model, stages, loss)
        restored = all("unshard" not in vars(g) for _, m in stage_units(stages) for g in _groups(m))
        out[depth] = {"schedule": schedule.as_dict(), "trace": trace, "losses": losses, "restored": restored}
    return out


@pytest.fixture(scope="module")
def toy_results():
    return run_distributed(_toy_body, WORLD, ranks_per_node=RANKS_PER_NODE)


@pytest.mark.parametrize("depth", [1, 2])
def test_scheduled_all_gather_order(toy_results, depth):
    for rank_result in toy_results:
        check_scheduled_order(rank_result[depth]["schedule"], rank_result[depth]["trace"])
    forward = toy_results[0][depth]["trace"].unshards("forward")
    if depth == 1:  # the embedding gathers itself, then every hook requests exactly the next stage
        assert forward == ["embed", *[u for i in range(4) for u in (f"layers.{i}", f"layers.{i}.experts")], "head"]


def test_default_all_gather_order(toy_results):
    for rank_result in toy_results:
        check_default_order(rank_result[0]["schedule"], rank_result[0]["trace"])
    off, on = toy_results[0][0]["trace"], toy_results[0][1]["trace"]
    assert off.as_list() != on.as_list()
    assert [e.kind for e in off.events] != [e.kind for e in on.events]


def test_every_unit_gathered_once_per_pass(toy_results):
    for depth in DEPTHS:
        result = toy_results[0][depth]
        forward, backward = result["trace"].unshards("forward"), result["trace"].unshards("backward")
        assert sorted(forward) == sorted(u for s in result["schedule"]["stages"] for u in s["units"])
        assert len(set(backward)) == len(backward)


def test_loss_identical_with_and_without_prefetch(toy_results):
    for rank_result in toy_results:
        losses = [rank_result[d]["losses"] for d in DEPTHS]
        assert losses[0] == losses[1] == losses[2], losses
        assert losses[0][-1] < losses[0][0]  # it trains


def test_recorder_restores_fsdp(toy_results):
    assert all(r[d]["restored"] for r in toy_results for d in DEPTHS)


def test_checks_catch_a_wrong_order(toy_results):
    """The order checks fail on the other order: the default order is no scheduled one, and back."""
    result_off, result_on = toy_results[0][0], toy_results[0][1]
    with pytest.raises(AssertionError):
        check_scheduled_order(result_on["schedule"], result_off["trace"])
    with pytest.raises(AssertionError):
        check_default_order(result_on["schedule"], result_on["trace"])
