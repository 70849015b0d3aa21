"""Background saves and the reusable stager: a checkpoint is published only after its write ended, holds the values
of the moment it started although the state changes meanwhile, and a failed write is never published; the
staging buffers are allocated once and reused. The CUDA test (skipped without a GPU) checks that a save blocks
the host for milliseconds and that the optimizer-side wait is on the device."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from moeshard import checkpoint as ckpt
from moeshard.checkpoint import CheckpointSaveError, Stager
from moeshard.checkpoint._stage import state_bytes


def test_published_after_the_write_with_the_values_of_its_start(world_of_one, tmp_path):
    writing, release = threading.Event(), threading.Event()

    class HeldWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            writing.set()
            assert release.wait(60)
            return super().write_data(plan, planner)

    d, w = tmp_path / "ckpts", torch.arange(8.0)
    stager = Stager(torch.device("cpu"))
    pending = ckpt.start_async_save(
        d, 3, {"model": {"w": w}}, {"step": 3}, {"rng": torch.tensor(3)}, keep_last=2,
        group=dist.new_group(backend="gloo"), stager=stager, writer_factory=lambda p, s: HeldWriter(str(p)),
    )  # fmt: skip
    pending.wait_staged()
    w.add_(100.0)  # the next optimizer step changes the live state while the write is pending
    assert writing.wait(60)
    assert pending.publish_if_done() is None  # still writing: not published
    assert not (d / "step_00000003").exists() and (d / ".tmp-step_00000003/extra.json").is_file()
    release.set()
    saved = pending.wait()
    assert saved.path == d / "step_00000003" and sorted(p.name for p in d.iterdir()) == ["step_00000003"]
    assert saved.bytes == 32 and saved.write_s > 0
    ckpt.validate_checkpoint(saved.path)  # COMPLETE records every file, as a synchronous save's
    state = {"model": {"w": torch.zeros(8)}}
    extra, rank_state = ckpt.load_checkpoint(saved.path, state)
    assert state["model"]["w"].tolist() == [float(i) for i in range(8)]  # the values when the save began
    assert extra == {"step": 3} and rank_state["rng"].item() == 3


def test_a_failed_background_write_is_never_published(world_of_one, tmp_path):
    class Full(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device", self.path)

    d = tmp_path / "ckpts"
    ckpt.save_checkpoint(d, 2, {"model": {"w": torch.ones(4)}}, {"step": 2}, {}, keep_last=2)
    pending = ckpt.start_async_save(
        d, 4, {"model": {"w": torch.zeros(4)}}, {"step": 4}, {}, keep_last=2, group=dist.new_group(backend="gloo"),
        stager=Stager(torch.device("cpu")), writer_factory=lambda p, s: Full(str(p)),
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not pending.upload.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pending.publish_if_done() is None  # rank 0 never publishes a failed write
    with pytest.raises(CheckpointSaveError) as e:
        pending.wait()
    message = str(e.value)
    assert "saving the checkpoint of step 4 (in the background) failed (rank 0: OSError" in message
    assert "No space left on device" in message and f"the previous checkpoint {d}/step_00000002 is intact" in message
    assert "\n" not in message
    assert sorted(p.name for p in d.iterdir()) == ["step_00000002"]  # no step_4, no temporary folder


def test_the_stager_reuses_its_buffers_and_copies_the_values_of_the_moment(world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    live = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
    state = {"model": {"w": live, "b": torch.ones(3)}, "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    stager = Stager(torch.device("cpu"))
    assert stager.allocate(state) == 12 * 4 + 3 * 4 and state_bytes(state) == 60
    first = stager.stage(state)
    assert isinstance(first["model"]["w"], DTensor) and first["model"]["w"].placements == (Shard(0),)
    live._local_tensor.add_(1.0)  # the live state changes; the staged copy does not
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    assert first["model"]["w"].to_local()[0, 0].item() == 0.0
    assert first["optimizer"]["param_groups"][0]["lr"] == 0.1
    second = stager.stage(state)
    # the same host buffers, refilled; the hyper-parameters of the moment
    assert second["model"]["w"].to_local().data_ptr() == first["model"]["w"].to_local().data_ptr()
    assert second["model"]["b"].data_ptr() == first["model"]["b"].data_ptr()
    assert second["model"]["w"].to_local()[0, 0].item() == 1.0 and second["optimizer"]["param_groups"][0]["lr"] == 0.2
    assert second["model"]["w"].to_local().data_ptr() != live.to_local().data_ptr()  # never aliases the live state
    stager.close()  # torch 2.11's async_save closes it after each save: the buffers stay
    assert stager.stage(state)["model"]["b"].data_ptr() == first["model"]["b"].data_ptr()
    stager.release()
    assert stager.allocated_bytes == 0


def _split(master: torch.Tensor):
    from moeshard.fsdp_moe import SplitMaster, split_master

    return SplitMaster(*split_master(master))


def test_split_masters_are_written_as_the_float32_masters_they_stand_for(world_of_one, tmp_path):
    """A ``SplitMaster`` entry (``model_state(..., masters="split")``) is written as its float32 master: through
    the stager (joined into its host buffer) and by a save without one (joined before DCP writes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from moeshard.fsdp_moe import SplitMaster

    g = torch.Generator().manual_seed(0)
    masters = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(300, generator=g) * 1e4}
    state = {"model": {k: _split(m) for k, m in masters.items()} | {"c": torch.ones(3)}}
    mesh = init_device_mesh("cpu", (1,))  # a DTensor entry, as the experts' (global shape, placements kept)
    hi, lo = (DTensor.from_local(t, mesh, [Shard(0)]) for t in (state["model"]["a"].hi, state["model"]["a"].lo))
    state["model"]["d"] = SplitMaster(hi, lo)
    masters["d"] = masters["a"]
    assert state_bytes(state) == (35 + 300 + 3 + 35) * 4
    stager = Stager(torch.device("cpu"))
    staged = stager.stage(state)
    assert isinstance(staged["model"]["d"], DTensor) and staged["model"]["d"].placements == (Shard(0),)
    for k, m in masters.items():
        got = staged["model"][k].to_local() if k == "d" else staged["model"][k]
        assert got.dtype == torch.float32 and torch.equal(got, m), k
    assert staged["model"]["c"].data_ptr() != state["model"]["c"].data_ptr()
    group = dist.new_group(backend="gloo")
    pending = ckpt.start_async_save(
        tmp_path / "bg", 1, state, {"step": 1}, {}, keep_last=2, group=group, stager=stager
    )  # fmt: skip
    saved = [pending.wait(), ckpt.save_checkpoint(tmp_path / "fg", 1, state, {"step": 1}, {}, keep_last=2)]
    for s in saved:
        back = {"model": {"a": torch.zeros(5, 7), "b": torch.zeros(300), "c": torch.zeros(3), "d": torch.zeros(5, 7)}}
        ckpt.load_checkpoint(s.path, back)
        for k, m in masters.items():
            assert torch.equal(back["model"][k], m), (s.path, k)
        assert s.bytes == (35 + 300 + 3 + 35) * 4
    stager.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_split_masters_are_joined_one_at_a_time(world_of_one):
    """On CUDA the stager joins split masters into one scratch the size of the largest: the device holds that,
    not every joined master at once, and the host buffers get the masters' bits."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    masters = [torch.randn(n << 20, device=dev) for n in (16, 64, 32, 64)]  # 176 Mi elements, 0.7 GiB joined
    state = {"model": {f"w{i}": _split(m) for i, m in enumerate(masters)}}
    expected = [m.cpu() for m in masters]
    del masters
    stager = Stager(dev)
    stager.allocate(state)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    staged = stager.stage(state).result()
    peak = torch.cuda.max_memory_allocated(dev) - before
    assert peak <= (64 << 20) * 4 + (1 << 20), peak  # one scratch of the largest piece
    for i, t in enumerate(expected):
        assert torch.equal(staged["model"][f"w{i}"], t)
    torch.cuda.synchronize()
    probe = torch.empty(1, device=dev)  # an allocation takes in the frees the side stream's copies held back
    assert torch.cuda.memory_allocated(dev) <= before + probe.untyped_storage().nbytes() + 512  # the scratch freed
    stager.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_blocks_the_host_for_milliseconds_and_the_step_waits_on_the_device(world_of_one):
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    live = [torch.randn(64 << 20, device=dev) for _ in range(4)]  # 1 GiB
    state = {"model": {f"w{i}": t for i, t in enumerate(live)}}
    stager = Stager(dev)
    stager.allocate(state)
    expected = [t.cpu() for t in live]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    future = stager.stage(state)
    issued = time.perf_counter() - t0
    stager.wait_staged()  # the compute stream waits for the copies; the host does not
    for t in live:
        t.mul_(2.0)  # the optimizer step, queued after the copies on the device
    waited = time.perf_counter() - t0
    staged = future.result()
    for i, t in enumerate(expected):
        assert torch.equal(staged["model"][f"w{i}"], t)
    assert staged["model"]["w0"].is_pinned()
    assert issued < 0.2 and waited < 0.2, (issued, waited)
    stager.release()


@pytest.fixture
def cuda_world_of_one():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
    yield dev
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_background_save_of_dtensors_keeps_the_values_of_its_start(cuda_world_of_one, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = cuda_world_of_one
    mesh = init_device_mesh("cuda", (1,))
    w = distribute_tensor(torch.randn(1024, 1024, device=dev), mesh, [Shard(0)])
    b = torch.randn(4096, device=dev)
    state = {"model": {"w": w, "b": b}, "optimizer": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    expected = {"w": w.to_local().cpu(), "b": b.cpu()}
    stager = Stager(dev)
    stager.allocate(state)
    group = dist.new_group(backend="gloo")
    for step in (1, 2):  # the second save reuses the first one's buffers (torch 2.11 closes the stager after each)
        pending = ckpt.start_async_save(
            tmp_path, step, state, {"step": step}, {}, keep_last=2, group=group, stager=stager
        )
        pending.wait_staged()
        w.to_local().add_(1.0)  # the optimizer step, after the copies on the device
        b.add_(1.0)
        saved = pending.wait()
        back = {"model": {"w": torch.zeros(1024, 1024), "b": torch.zeros(4096)}}
        ckpt.load_checkpoint(saved.path, {"model": back["model"]})
        assert torch.equal(back["model"]["w"], expected["w"]) and torch.equal(back["model"]["b"], expected["b"])
        expected = {"w": w.to_local().cpu(), "b": b.cpu()}
        assert saved.blocking_s < 1.0 and saved.write_s > 0
    stager.release()


def test_staging_writes_into_a_dtensors_local_piece():
    """The stager fills a DTensor buffer through ``local_piece`` (``to_local`` outside autograd): writing into the
    piece is writing into the DTensor, for a parameter (a new view each call on torch >= 2.13) as for a tensor."""
    from torch.distributed.tensor import DTensor, Shard

    from moeshard.checkpoint._stage import local_piece
    from moeshard.meshes import fake_process_group

    with fake_process_group(1):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for t in (DTensor.from_local(torch.zeros(4), mesh, [Shard(0)]), torch.nn.Parameter(torch.zeros(4))):
            t = t if isinstance(t, DTensor) else torch.nn.Parameter(DTensor.from_local(t.data, mesh, [Shard(0)]))
            with torch.no_grad():
                local_piece(t).copy_(torch.arange(4.0))
            assert torch.equal(t.to_local().detach(), torch.arange(4.0)), type(t)
            assert type(local_piece(t)) is not DTensor
    plain = torch.ones(2)
    assert local_piece(plain) is plain
