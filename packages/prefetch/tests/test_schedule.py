"""The schedule as data for a 4-layer toy (planned on the fake backend, world 4 = 2 nodes x 2, EP 2)."""

import json
from types import SimpleNamespace

import pytest
from torch import nn

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.prefetch import PrefetchSchedule, apply_schedule, build_schedule, stage_units
from moeshard.prefetch.testing import ToyMoE, shard_toy

STAGES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]


def _layer(i: int) -> list[str]:
    return [f"layers.{i}", f"layers.{i}.experts"]


EXPECTED = {
    0: [(s, [], []) for s in STAGES],
    1: [
        ("embed", _layer(0), []),
        ("layers.0", _layer(1), ["embed"]),
        ("layers.1", _layer(2), _layer(0)),
        ("layers.2", _layer(3), _layer(1)),
        ("layers.3", ["head"], _layer(2)),
        ("head", [], _layer(3)),
    ],
    2: [
        ("embed", _layer(0) + _layer(1), []),
        ("layers.0", _layer(1) + _layer(2), ["embed"]),
        ("layers.1", _layer(2) + _layer(3), _layer(0) + ["embed"]),
        ("layers.2", _layer(3) + ["head"], _layer(1) + _layer(0)),
        ("layers.3", ["head"], _layer(2) + _layer(1)),
        ("head", [], _layer(3) + _layer(2)),
    ],
}


@pytest.fixture(scope="module")
def toy_stages():
    with fake_process_group(4, rank=0):
        meshes = build_meshes(ep_size=2, ranks_per_node=2, device_type="cpu")
        model = ToyMoE(num_layers=4, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
        yield shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_schedule_as_data(toy_stages, depth):
    schedule = build_schedule(toy_stages, depth=depth)
    data = schedule.as_dict()
    assert data["depth"] == depth and data["enabled"] == (depth > 0)
    got = [(s["name"], s["forward"], s["backward"]) for s in data["stages"]]
    assert got == EXPECTED[depth]
    # The owner of each stage's lists is its first unit; layer stages hold the layer unit, then its experts.
    assert [s["unit"] for s in data["stages"]] == STAGES
    assert data["stages"][1]["units"] == ["layers.0", "layers.0.experts"]
    assert json.loads(json.dumps(data)) == data


def test_default_depth_is_one(toy_stages):
    assert build_schedule(toy_stages).as_dict() == build_schedule(toy_stages, depth=1).as_dict()


def test_describe_lists_units_per_stage(toy_stages):
    text = build_schedule(toy_stages, depth=1).describe()
    assert "depth 1" in text
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert "layers.2, layers.2.experts" in lines["layers.1"] and "layers.0, layers.0.experts" in lines["layers.1"]
    assert lines["head"].split() == ["head", "-", "layers.3,", "layers.3.experts"]
    assert "off" in build_schedule(toy_stages, depth=0).describe()


def _prefetch_lists(module, stages):
    """The units FSDP2 will prefetch from ``module`` (read back from its state), by name."""
    names = {id(m._get_fsdp_state()): n for n, m in stage_units(stages)}
    state = module._get_fsdp_state()
    return [names[id(s)] for s in state._states_to_forward_prefetch], [
        names[id(s)] for s in state._states_to_backward_prefetch
    ]


def test_apply_sets_fsdp_lists_and_off_restores_defaults(toy_stages):
    apply_schedule(build_schedule(toy_stages, depth=2))
    for (name, fwd, bwd), stage in zip(EXPECTED[2], toy_stages):
        assert _prefetch_lists(stage.modules[0][1], toy_stages) == (fwd, bwd), name
    # Expert units keep FSDP2's defaults (their layer unit's hooks issue the prefetches).
    assert _prefetch_lists(toy_stages[1].modules[1][1], toy_stages) == ([], [])
    apply_schedule(build_schedule(toy_stages, depth=0))
    assert all(_prefetch_lists(m, toy_stages) == ([], []) for _, m in stage_units(toy_stages))


def test_depth_beyond_the_model_is_clamped(toy_stages):
    data = build_schedule(toy_stages, depth=10).as_dict()["stages"]
    assert data[0]["forward"] == [u for s in toy_stages[1:] for u, _ in s.modules]
    assert data[-1]["forward"] == [] and data[0]["backward"] == []


@pytest.mark.parametrize("depth", [-1, 1.0, True, "1"])
def test_bad_depth_is_refused(toy_stages, depth):
    with pytest.raises(ValueError, match="depth"):
        build_schedule(toy_stages, depth=depth)


def test_duck_typed_stages_and_validation():
    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    stages = [SimpleNamespace(name="s0", modules=[("a", a)]), SimpleNamespace(name="s1", modules=[("b", b), ("c", c)])]
    schedule = build_schedule(stages)
    assert isinstance(schedule, PrefetchSchedule) and schedule.module("c") is c
    assert [(s.forward, s.backward) for s in schedule.stages] == [(("b", "c"), ()), ((), ("a",))]
    with pytest.raises(ValueError, match="not an FSDPModule"):
        apply_schedule(schedule)
    with pytest.raises(ValueError, match="no modules"):
        build_schedule([SimpleNamespace(name="s", modules=[])])
    with pytest.raises(ValueError, match="appears twice"):
        build_schedule([SimpleNamespace(name="s", modules=[("a", a), ("a", b)])])
    with pytest.raises(ValueError, match="same module"):
        build_schedule([SimpleNamespace(name="s", modules=[("a", a)]), SimpleNamespace(name="t", modules=[("b", a)])])
    assert build_schedule([]).as_dict() == {"depth": 1, "enabled": True, "stages": []}
