"""Prefetch schedules on the real tiny Qwen3-MoE, 4 gloo processes (2 nodes x 2): the recorded all-gather order of
one real step with and without the schedule, forward prefetches issued at the EP host sync, and the same losses.

Cross-package (moeshard.prefetch with moeshard.ep, moeshard.fsdp_moe and the model); the toy-model checks of the
same order are in packages/prefetch/tests/test_order_dist.py. One spawn serves every test: EP 2 on nodes of 2, then
EP 4 on the same 4 ranks taken as one node.
"""

import math

import pytest
import torch
import torch.distributed as dist

from moeshard.ep import apply_ep
from moeshard.fsdp_moe import shard_model
from moeshard.meshes import build_meshes
from moeshard.meshes.testing import run_distributed
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config
from moeshard.prefetch import apply_schedule, build_schedule, prefetch_forward_at_host_sync
from moeshard.prefetch.testing import check_default_order, check_scheduled_order, layer_stages, train_and_record

WORLD, RANKS_PER_NODE, EP = 4, 2, 2


def _qwen3_body(ep_size, ranks_per_node=None):
    meshes = build_meshes(ep_size=ep_size, device_type="cpu", ranks_per_node=ranks_per_node)
    config = get_preset_config("tiny", num_hidden_layers=4)
    out = {}
    for depth in (0, 1, "sync"):
        model = Qwen3MoeForCausalLM(config)
        model.init_weights(torch.Generator().manual_seed(0))  # the same full model on every rank, before slicing
        ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
        units = shard_model(model, meshes, ep_info=ep_info)
        schedule = build_schedule(units.stages, depth=1 if depth == "sync" else depth)
        apply_schedule(schedule)
        hooks = None
        if depth == "sync":
            hooks = prefetch_forward_at_host_sync(schedule, ep_info.add_host_sync_hook)

        def loss(step, model=model):
            gen = torch.Generator().manual_seed(dist.get_rank())  # the same batch each step: the loss must fall
            ids = torch.randint(0, config.vocab_size, (1, 16), generator=gen)
            return model(ids, labels=ids).loss

        losses, trace = train_and_record(model, units.stages, loss)
        if hooks is not None:
            hooks.remove()
        out[depth] = {
            "schedule": schedule.as_dict(),
            "trace": trace,
            "losses": losses,
            "local_experts": [name for name, _ in units.local_experts],
        }
    return out


def _both_layouts():
    return {"ep2": _qwen3_body(EP), "ep4": _qwen3_body(WORLD, ranks_per_node=WORLD)}


@pytest.fixture(scope="module")
def both_layouts():
    return run_distributed(_both_layouts, WORLD, ranks_per_node=RANKS_PER_NODE)


@pytest.fixture(scope="module")
def qwen3_results(both_layouts):
    return [r["ep2"] for r in both_layouts]


def test_qwen3_scheduled_and_default_order(qwen3_results):
    for rank_result in qwen3_results:
        check_default_order(rank_result[0]["schedule"], rank_result[0]["trace"])
        check_scheduled_order(rank_result[1]["schedule"], rank_result[1]["trace"])


def test_qwen3_loss_identical_with_and_without_prefetch(qwen3_results):
    for rank_result in qwen3_results:
        losses = rank_result[0]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert rank_result[1]["losses"] == losses


def test_qwen3_forward_prefetch_at_host_sync(qwen3_results):
    """Issued at the EP split-size sync: each layer's units are all-gathered inside the previous layer's forward
    (after its expert unit began, before the layer ended), the same units as the pre-forward schedule, same losses."""
    for rank_result in qwen3_results:
        result, scheduled = rank_result["sync"], rank_result[1]
        trace = result["trace"]
        assert sorted(trace.unshards("forward")) == sorted(scheduled["trace"].unshards("forward"))
        layers = layer_stages(result["schedule"])
        for (unit, _), (_, next_units) in zip(layers, layers[1:]):
            begin, end = trace.index("forward_begin", unit, "forward"), trace.index("forward_end", unit, "forward")
            experts_begin = trace.index("forward_begin", f"{unit}.mlp.experts", "forward")  # the sync is in there
            for target in next_units:
                issued = trace.index("unshard", target, "forward")
                assert begin < experts_begin < issued < end, (unit, target)
                assert trace.events[issued].prefetch, target
        assert result["losses"] == rank_result[0]["losses"]


@pytest.fixture(scope="module")
def qwen3_ep4_results(both_layouts):
    return [r["ep4"] for r in both_layouts]


def test_qwen3_without_expert_units(qwen3_ep4_results):
    """EP 4 x ep_fsdp 1: the experts are no FSDP units (nothing to gather), so each layer's stage is its layer unit
    alone; the schedule prefetches those, and training is the same with and without it."""
    for rank_result in qwen3_ep4_results:
        for depth in (0, 1):
            result = rank_result[depth]
            assert len(result["local_experts"]) == 4
            assert all(len(units) == 1 for _, units in layer_stages(result["schedule"]))
            gathered = result["trace"].unshards("forward") + result["trace"].unshards("backward")
            assert not any(".experts" in u for u in gathered)
        check_default_order(rank_result[0]["schedule"], rank_result[0]["trace"])
        check_scheduled_order(rank_result[1]["schedule"], rank_result[1]["trace"])
        losses = rank_result[0]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert rank_result[1]["losses"] == losses
