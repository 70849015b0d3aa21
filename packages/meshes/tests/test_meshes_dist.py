"""Real meshes on gloo (4 processes as 2 nodes x 2) and planned meshes on the fake backend (world 16)."""

import pytest
import torch
import torch.distributed as dist

from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import DistributedRerunWarning, DistributedTestError, run_distributed


def _groups_by_all_gather():
    meshes = build_meshes(ep_size=2)
    out = {}
    for axis, mesh in (("ep", meshes.ep), ("ep_fsdp", meshes.ep_fsdp), ("fsdp", meshes.fsdp)):
        group = mesh.get_group()
        ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(ranks, torch.tensor([dist.get_rank()]), group=group)
        out[axis] = [int(r) for r in ranks]
    out["node"] = meshes.node_index
    return out


def test_gloo_meshes_two_nodes_of_two():
    res = run_distributed(_groups_by_all_gather, 4, ranks_per_node=2)
    assert [r["ep"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep_fsdp"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["fsdp"] == [0, 1, 2, 3] for r in res)
    assert [r["node"] for r in res] == [0, 0, 1, 1]


@pytest.mark.parametrize("rank", range(16))
def test_fake_world_16(rank):
    with fake_process_group(16, rank):
        meshes = build_meshes(ep_size=8, ranks_per_node=8, device_type="cpu")
        assert meshes.ep.mesh.tolist() == list(range(8 * (rank // 8), 8 * (rank // 8) + 8))
        assert meshes.ep_fsdp.mesh.tolist() == [rank % 8, rank % 8 + 8]
        assert meshes.fsdp.mesh.tolist() == list(range(16))
        assert dist.get_world_size(meshes.ep.get_group()) == 8
        assert dist.get_world_size(meshes.ep_fsdp.get_group()) == 2
        assert meshes.node_index == rank // 8 and meshes.ep_rank == rank % 8


@pytest.mark.parametrize("rank", [0, 5, 9, 15])
def test_fake_world_16_sequence_groups(rank):
    with fake_process_group(16, rank):
        meshes = build_meshes(ep_size=4, ranks_per_node=8, device_type="cpu", sp_size=2)
        start = rank - rank % 2
        assert meshes.sp.mesh.tolist() == [start, start + 1]
        assert dist.get_world_size(meshes.sp.get_group()) == 2
        assert (meshes.sp_size, meshes.sp_rank, meshes.dp_size, meshes.dp_rank) == (2, rank % 2, 8, rank // 2)
        assert meshes.ep.mesh.tolist() == list(range(4 * (rank // 4), 4 * (rank // 4) + 4))  # EP unchanged
        assert f"sp group [{start}, {start + 1}]" in meshes.describe()
        with pytest.raises(ValueError, match="sp_size 16 does not divide the 8 ranks per node"):
            build_meshes(ep_size=4, ranks_per_node=8, device_type="cpu", sp_size=16)
    with fake_process_group(16, rank):
        assert build_meshes(ep_size=4, ranks_per_node=8, device_type="cpu").sp is None


def _world_spanning_groups():
    ep_world = build_meshes(ep_size=dist.get_world_size())  # the EP group is every rank
    fsdp_world = build_meshes(ep_size=1)  # the ep_fsdp group is every rank
    groups = [ep_world.ep.get_group(), fsdp_world.ep_fsdp.get_group()]
    # a communicator of their own: the same ranks as FSDP's group, a different group (so the EP exchange never
    # queues behind FSDP's collectives), and it works
    t = torch.ones(1)
    for g in groups:
        dist.all_reduce(t, group=g)
    return {
        "same_ranks": [dist.get_process_group_ranks(g) == [0, 1] for g in groups],
        "own_group": [g is not ep_world.fsdp.get_group() and g is not dist.group.WORLD for g in groups],
        "sum": float(t),
    }


def test_world_spanning_expert_groups_are_not_the_fsdp_group():
    for res in run_distributed(_world_spanning_groups, 2):
        assert res == {"same_ranks": [True, True], "own_group": [True, True], "sum": 4.0}


def test_build_meshes_needs_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        build_meshes(ep_size=1)


def _fails_on_rank_one(count):
    if dist.get_rank() == 1:
        with open(count, "a") as f:
            f.write("run\n")
        print("rank one prints before it fails")
        raise ValueError("boom on rank one")
    dist.barrier()  # the others block on the failed rank: the harness must not hang


def _hangs():
    import time

    if dist.get_rank() == 0:
        time.sleep(3600)


def _crashes(count, times):
    """Rank 1 aborts (a crash in native code: SIGABRT, no Python error) in its first ``times`` runs."""
    import os

    if dist.get_rank() == 1:
        with open(count, "a") as f:
            f.write("run\n")
        with open(count) as f:
            runs = len(f.readlines())
        if runs <= times:
            print(f"rank one about to crash in run {runs}", flush=True)
            os.abort()
    dist.barrier()
    return dist.get_rank()


def _runs(path):
    with open(path) as f:
        return len(f.readlines())


def test_harness_reports_failing_rank_traceback(tmp_path):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fails_on_rank_one, 2, str(tmp_path / "count"), timeout=60)
    message = str(info.value)
    assert "rank 1 failed" in message and "boom on rank one" in message
    assert "rank one prints before it fails" in message  # the rank's own output, read back
    assert _runs(tmp_path / "count") == 1  # a Python error never reruns


def test_harness_reruns_a_crash_once_with_its_report(tmp_path):
    with pytest.warns(DistributedRerunWarning) as record:
        assert run_distributed(_crashes, 2, str(tmp_path / "count"), 1, timeout=60) == [0, 1]
    assert _runs(tmp_path / "count") == 2
    (warning,) = record
    message = str(warning.message)
    assert "process exited with code -6" in message and "rank one about to crash in run 1" in message
    assert "Fatal Python error: Aborted" in message  # faulthandler's stack of the crash
    with pytest.raises(DistributedTestError, match="about to crash in run 3"):  # a crash with no rerun left fails
        run_distributed(_crashes, 2, str(tmp_path / "count"), 9, timeout=60, reruns_after_crash=0)


def test_harness_times_out_on_hang():
    with pytest.raises(DistributedTestError, match="did not finish within"):
        run_distributed(_hangs, 2, timeout=15)


def _returns_tensor():
    return torch.full((3,), float(dist.get_rank()))


def test_harness_returns_tensors_by_value():
    out = run_distributed(_returns_tensor, 2)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3]
