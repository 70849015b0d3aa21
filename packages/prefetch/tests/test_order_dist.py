"""Evidence on 4 gloo processes (2 nodes x 2, EP 2, ep_fsdp 2): the recorded all-gather order of one real step,
with and without the schedule, and the same losses either way.

One spawn per model serves every test of it (module-scoped fixtures): each rank builds the model once per depth,
trains three steps, records the second.
"""

import importlib.util
import math

import pytest
import torch
import torch.distributed as dist

from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed
from moeshard.prefetch import (
    apply_schedule,
    build_schedule,
    prefetch_forward_at_host_sync,
    record_unshard_order,
    stage_units,
)
from moeshard.prefetch.testing import ToyMoE, shard_toy

WORLD, RANKS_PER_NODE, EP = 4, 2, 2
DEPTHS = (0, 1, 2)
STEPS, RECORDED_STEP = 3, 1


def _train(model, stages, depth, batch_fn, at_host_sync=False):
    """Apply the schedule for ``depth``, train ``STEPS`` steps recording one; return what the tests check."""
    schedule = build_schedule(stages, depth=depth)
    apply_schedule(schedule)
    hooks = None
    if at_host_sync:
        from moeshard.ep import register_host_sync_hook

        hooks = prefetch_forward_at_host_sync(schedule, register_host_sync_hook)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, trace = [], None
    for step in range(STEPS):
        if step == RECORDED_STEP:
            with record_unshard_order(stage_units(stages)) as trace:
                loss = batch_fn(step)
                loss.backward()
        else:
            loss = batch_fn(step)
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    if hooks is not None:
        hooks.remove()
    restored = all(
        "unshard" not in vars(g) for _, m in stage_units(stages) for g in _groups(m)
    )  # the recorder leaves nothing behind
    return {"schedule": schedule.as_dict(), "events": trace.as_list(), "losses": losses, "restored": restored}


def _groups(module):
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]


def _toy_body():
    meshes = build_meshes(ep_size=EP, device_type="cpu")
    out = {}
    for depth in DEPTHS:
        model = ToyMoE(num_layers=4, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
        stages = shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)

        def batch(step, model=model):
            gen = torch.Generator().manual_seed(dist.get_rank())  # the same batch each step: the loss must fall
            tokens = torch.randint(0, 32, (2, 8), generator=gen)
            return model(tokens, torch.roll(tokens, -1, dims=1))

        out[depth] = _train(model, stages, depth, batch)
    return out


def _qwen3_body(ep_size=EP):
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    meshes = build_meshes(ep_size=ep_size, device_type="cpu")
    config = get_preset_config("tiny", num_hidden_layers=4)
    out = {}
    for depth in (0, 1, "sync"):
        model = Qwen3MoeForCausalLM(config)
        model.init_weights(torch.Generator().manual_seed(0))  # the same full model on every rank, before slicing
        apply_ep(model, model.get_parallel_plan(), meshes.ep)
        units = shard_model(model, meshes)

        def batch(step, model=model):
            gen = torch.Generator().manual_seed(dist.get_rank())  # the same batch each step: the loss must fall
            ids = torch.randint(0, config.vocab_size, (1, 16), generator=gen)
            return model(ids, labels=ids).loss

        out[depth] = _train(model, units.stages, 1 if depth == "sync" else depth, batch, at_host_sync=depth == "sync")
        out[depth]["local_experts"] = [name for name, _ in units.local_experts]
    return out


# ---------------------------------------------------------------------------------------------------- checks


def _pos(events, kind, unit, phase):
    """Index of the first ``kind`` event of ``unit`` in ``phase``."""
    for i, e in enumerate(events):
        if e["kind"] == kind and e["unit"] == unit and e["phase"] == phase:
            return i
    raise AssertionError(f"no {kind} of {unit!r} in {phase}")


def _layer_stages(schedule):
    """(layer unit, its units) for each decoder-layer stage: every stage but the first and the last."""
    return [(s["unit"], s["units"]) for s in schedule["stages"][1:-1]]


def check_scheduled_order(result):
    """Layer i's hooks request layer i+1 (forward) and layer i-1 (backward), attention and experts alike."""
    events, schedule = result["events"], result["schedule"]
    layers = _layer_stages(schedule)
    stages = schedule["stages"]
    for (unit, _), (_, next_units) in zip(layers, layers[1:]):
        for target in next_units:
            assert _pos(events, "unshard", target, "forward") < _pos(events, "forward_end", unit, "forward"), target
    for (_, prev_units), (unit, _) in zip(layers, layers[1:]):
        for target in prev_units:
            assert _pos(events, "unshard", target, "backward") < _pos(events, "backward_end", unit, "backward"), target
    # Each prefetch is issued from the hook of the first stage that lists it: between that stage's begin and
    # the next unit's begin (nothing else has run yet).
    for phase, key, order in (("forward", "forward", stages), ("backward", "backward", stages[::-1])):
        requester = {}
        for s in order:
            for target in s[key]:
                requester.setdefault(target, s["unit"])
        for target, owner in requester.items():
            begin = _pos(events, f"{phase}_begin", owner, phase)
            issued = _pos(events, "unshard", target, phase)
            later_begins = [i for i, e in enumerate(events) if i > begin and e["kind"] == f"{phase}_begin"]
            assert begin < issued < (later_begins[0] if later_begins else len(events)), (phase, target, owner)
            assert events[issued]["prefetch"], (phase, target)


def check_default_order(result):
    """FSDP2 alone: a layer's units are all-gathered only once its own forward begins, and in backward a
    layer's experts only once that layer's backward begins."""
    events = result["events"]
    layers = _layer_stages(result["schedule"])
    for (unit, _), (_, next_units) in zip(layers, layers[1:]):
        end = _pos(events, "forward_end", unit, "forward")
        for target in next_units:
            issued = _pos(events, "unshard", target, "forward")
            assert issued > _pos(events, "forward_begin", target, "forward") > end, target
            assert not events[issued]["prefetch"]
    for (_, prev_units), (unit, _) in zip(layers, layers[1:]):
        end = _pos(events, "backward_end", unit, "backward")
        # FSDP2's default backward prefetch (reverse post-forward order, one unit ahead) reaches the previous
        # layer's unit from this layer's experts, but that layer's experts only from that layer's own pre-backward.
        for target in prev_units[1:]:
            assert _pos(events, "unshard", target, "backward") > end, target


def _unshards(result, phase):
    return [e["unit"] for e in result["events"] if e["kind"] == "unshard" and e["phase"] == phase]


# ---------------------------------------------------------------------------------------------------- toy model


@pytest.fixture(scope="module")
def toy_results():
    return run_distributed(_toy_body, WORLD, ranks_per_node=RANKS_PER_NODE)


@pytest.mark.parametrize("depth", [1, 2])
def test_scheduled_all_gather_order(toy_results, depth):
    for rank_result in toy_results:
        check_scheduled_order(rank_result[depth])
    forward = _unshards(toy_results[0][depth], "forward")
    if depth == 1:  # the embedding gathers itself, then every hook requests exactly the next stage
        assert forward == ["embed", *[u for i in range(4) for u in (f"layers.{i}", f"layers.{i}.experts")], "head"]


def test_default_all_gather_order(toy_results):
    for rank_result in toy_results:
        check_default_order(rank_result[0])
    off, on = toy_results[0][0], toy_results[0][1]
    assert off["events"] != on["events"]
    assert [e["kind"] for e in off["events"]] != [e["kind"] for e in on["events"]]


def test_every_unit_gathered_once_per_pass(toy_results):
    for depth in DEPTHS:
        result = toy_results[0][depth]
        forward = _unshards(result, "forward")
        assert sorted(forward) == sorted(u for s in result["schedule"]["stages"] for u in s["units"])
        assert len(set(_unshards(result, "backward"))) == len(_unshards(result, "backward"))


def test_loss_identical_with_and_without_prefetch(toy_results):
    for rank_result in toy_results:
        losses = [rank_result[d]["losses"] for d in DEPTHS]
        assert losses[0] == losses[1] == losses[2], losses
        assert losses[0][-1] < losses[0][0]  # it trains


def test_recorder_restores_fsdp(toy_results):
    assert all(r[d]["restored"] for r in toy_results for d in DEPTHS)


# ---------------------------------------------------------------------------------------------------- real tiny Qwen3-MoE


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package (moeshard.models)
        return False


_MISSING = [m for m in ("moeshard.ep", "moeshard.fsdp_moe", "moeshard.models.qwen3moe") if not _installed(m)]


@pytest.fixture(scope="module")
def qwen3_results():
    if _MISSING:
        pytest.skip(f"needs {', '.join(_MISSING)} (installed by `nox -s prefetch`)")
    return run_distributed(_qwen3_body, WORLD, ranks_per_node=RANKS_PER_NODE)


def test_qwen3_scheduled_and_default_order(qwen3_results):
    for rank_result in qwen3_results:
        check_default_order(rank_result[0])
        check_scheduled_order(rank_result[1])


def test_qwen3_loss_identical_with_and_without_prefetch(qwen3_results):
    for rank_result in qwen3_results:
        losses = rank_result[0]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert rank_result[1]["losses"] == losses


def test_qwen3_forward_prefetch_at_host_sync(qwen3_results):
    """Issued at the EP split-size sync: each layer's units are all-gathered inside the previous layer's forward
    (after its attention began, before it ended), the same units as the pre-forward schedule, same losses."""
    for rank_result in qwen3_results:
        result, scheduled = rank_result["sync"], rank_result[1]
        events = result["events"]
        assert sorted(_unshards(result, "forward")) == sorted(_unshards(scheduled, "forward"))
        layers = _layer_stages(result["schedule"])
        for (unit, _), (_, next_units) in zip(layers, layers[1:]):
            begin, end = _pos(events, "forward_begin", unit, "forward"), _pos(events, "forward_end", unit, "forward")
            # inside the layer, after its expert unit began (the sync is in the experts' forward)
            experts_begin = _pos(events, "forward_begin", f"{unit}.mlp.experts", "forward")
            for target in next_units:
                issued = _pos(events, "unshard", target, "forward")
                assert begin < experts_begin < issued < end, (unit, target)
                assert events[issued]["prefetch"], target
        assert result["losses"] == rank_result[0]["losses"]


@pytest.fixture(scope="module")
def qwen3_ep4_results():
    if _MISSING:
        pytest.skip(f"needs {', '.join(_MISSING)} (installed by `nox -s prefetch`)")
    return run_distributed(_qwen3_body, WORLD, WORLD, ranks_per_node=WORLD)


def test_qwen3_without_expert_units(qwen3_ep4_results):
    """EP 4 x ep_fsdp 1: the experts are no FSDP units (nothing to gather), so each layer's stage is its layer unit
    alone; the schedule prefetches those, and training is the same with and without it."""
    for rank_result in qwen3_ep4_results:
        for depth in (0, 1):
            result = rank_result[depth]
            assert len(result["local_experts"]) == 4
            assert all(len(units) == 1 for _, units in _layer_stages(result["schedule"]))
            assert not any(".experts" in u for u in _unshards(result, "forward") + _unshards(result, "backward"))
        check_default_order(rank_result[0])
        check_scheduled_order(rank_result[1])
        losses = rank_result[0]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert rank_result[1]["losses"] == losses
