"""Layout arithmetic and validation, no process group."""

import pytest

from moeshard.meshes import plan_layout


def test_worked_example_16_ranks():
    lay = plan_layout(16, 8, 8)
    assert lay.ep_fsdp_size == 2 and lay.num_nodes == 2
    assert lay.ep_groups() == [list(range(8)), list(range(8, 16))]
    assert lay.ep_fsdp_groups() == [[j, j + 8] for j in range(8)]
    assert [lay.node_of(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert not lay.ep_crosses_nodes()
    text = lay.describe()
    assert "[0..7], [8..15]" in text and "[0,8], [1,9]" in text


@pytest.mark.parametrize(
    ("world", "per_node", "ep", "needles"),
    [
        (8, 4, 0, ["ep_size must be an integer >= 1", "0"]),
        (8, 4, -2, ["ep_size must be an integer >= 1", "-2"]),
        (12, 4, 8, ["ep_size 8 does not divide world size 12"]),
        (16, 8, 16, ["ep_size 16", "cross a node boundary", "8 ranks per node"]),
        (12, 6, 4, ["ep_size 4", "cross a node boundary", "6 ranks per node"]),
        (10, 4, 2, ["world size 10 is not a multiple of ranks per node 4"]),
    ],
)
def test_validation_errors_name_the_numbers(world, per_node, ep, needles):
    with pytest.raises(ValueError) as info:
        plan_layout(world, per_node, ep)
    for needle in needles:
        assert needle in str(info.value)


def test_cross_node_ep_allowed_explicitly():
    lay = plan_layout(16, 8, 16, allow_cross_node_ep=True)
    assert lay.ep_crosses_nodes()
    assert lay.ep_fsdp_groups() == [[j] for j in range(16)]


@pytest.mark.parametrize(
    "backend, device_type, want",
    [("cpu:gloo,cuda:nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("nccl", "cuda", "nccl")],
)
def test_expert_groups_take_the_default_groups_backend_for_the_device(monkeypatch, backend, device_type, want):
    from moeshard.meshes import _build

    monkeypatch.setattr(_build.dist, "get_backend", lambda *a: backend)
    assert _build._backend_for(device_type) == want


def test_sequence_groups_are_consecutive_ranks_inside_a_node():
    lay = plan_layout(16, 8, 4, sp_size=4)
    assert lay.dp_size == 4 and lay.ep_size == 4  # sp cuts neither the expert mesh nor the world
    assert lay.sp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [lay.dp_rank_of(r) for r in (0, 3, 4, 15)] == [0, 0, 1, 3]
    assert [lay.sp_rank_of(r) for r in (0, 3, 4, 15)] == [0, 3, 0, 3]
    assert "sp 4 x dp 4" in lay.describe() and "[0..3], [4..7]" in lay.describe()
    assert "sp " not in plan_layout(16, 8, 4).describe()


@pytest.mark.parametrize(
    ("world", "per_node", "sp", "needle"),
    [
        (16, 8, 3, "sp_size 3 does not divide the 8 ranks per node (world size 16); choose an sp_size that divides 8"),
        (16, 8, 16, "sp_size 16 does not divide the 8 ranks per node"),
        (8, 8, 0, "sp_size must be an integer >= 1, got 0"),
    ],
)
def test_sp_that_does_not_divide_a_node_is_refused_in_one_line(world, per_node, sp, needle):
    with pytest.raises(ValueError) as info:
        plan_layout(world, per_node, 2, sp_size=sp)
    assert needle in str(info.value) and "\n" not in str(info.value)
