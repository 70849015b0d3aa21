"""Checkpoint folder rules: atomic publication, pruning, failed saves naming the right step, validation naming the
damaged file, the small files (JSON, tensors read with ``weights_only``; older ``extra.pt`` still read), free space
checked before any write."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from moeshard import checkpoint as ckpt
from moeshard.checkpoint import CheckpointSaveError


def _save(d: Path, step: int, keep_last: int = 2, **kw) -> Path:
    state = {"model": {"w": torch.full((4,), float(step))}}
    return ckpt.save_checkpoint(
        d, step, state, {"step": step}, {"rng": torch.tensor(step)}, keep_last=keep_last, **kw
    ).path


def _full_disk(path: Path, step: int) -> FileSystemWriter:
    class Full(FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    return Full(str(path))


def test_atomic_publication_and_pruning(world_of_one, tmp_path):
    d = tmp_path / "ckpts"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "step_00000001").mkdir()  # someone else's folder without COMPLETE: never ours to delete
    (d / ".tmp-step_00000002").mkdir()  # a save of ours that was killed
    for step in (2, 3, 4, 5):
        _save(d, step)
    names = sorted(p.name for p in d.iterdir())
    assert names == ["notes.txt", "step_00000001", "step_00000004", "step_00000005"]
    assert ckpt.newest_checkpoint(d).name == "step_00000005"
    assert ckpt.read_marker(d / "step_00000005")["step"] == 5
    state = {"model": {"w": torch.zeros(4)}}
    extra, rank_state = ckpt.load_checkpoint(d / "step_00000004", state)
    assert extra == {"step": 4} and rank_state["rng"].item() == 4 and state["model"]["w"].tolist() == [4.0] * 4
    assert json.loads((d / "step_00000004/extra.json").read_text()) == {"step": 4}
    # keep_last=1 keeps exactly the newest; a re-save of an existing step replaces it.
    _save(d, 5, keep_last=1)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "step_00000001", "step_00000005"]
    # A half-written newer folder (killed before its marker) is invisible to resume.
    (d / ".tmp-step_00000009").mkdir()
    assert ckpt.newest_checkpoint(d).name == "step_00000005"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.read_marker(d / ".tmp-step_00000009")


def test_several_writer_threads_write_several_files(world_of_one, tmp_path):
    state = {"model": {f"w{i}": torch.full((256,), float(i)) for i in range(8)}}
    options = ckpt.SaveOptions(thread_count=4)
    saved = ckpt.save_checkpoint(tmp_path, 1, state, {}, {}, keep_last=1, options=options)
    assert len(list(saved.path.glob("__0_*.distcp"))) == 4
    assert saved.bytes == 8 * 256 * 4 and saved.write_s > 0 and saved.gb_per_s > 0
    back = {"model": {f"w{i}": torch.zeros(256) for i in range(8)}}
    ckpt.load_checkpoint(saved.path, back)
    assert all(back["model"][f"w{i}"].eq(i).all() for i in range(8))
    with pytest.raises(ValueError, match="thread_count must be >= 1"):
        ckpt.SaveOptions(thread_count=0)


def test_a_failed_save_names_its_step_and_the_checkpoint_before_it(world_of_one, tmp_path):
    d = tmp_path / "ckpts"
    _save(d, 2)
    _save(d, 12, keep_last=5)  # newer, of an earlier run that went further: not the "previous" of step 6
    with pytest.raises(CheckpointSaveError) as e:
        _save(d, 6, keep_last=5, writer_factory=_full_disk)
    message = str(e.value)
    assert message.startswith("saving the checkpoint of step 6 failed (rank 0: OSError: [Errno 28] No space left")
    assert f"the previous checkpoint {d}/step_00000002 is intact" in message and "\n" not in message
    assert sorted(p.name for p in d.iterdir()) == ["step_00000002", "step_00000012"]  # no temporary folder


def test_too_little_space_is_one_line_before_any_write(world_of_one, tmp_path, monkeypatch):
    from moeshard.checkpoint import _space

    d = tmp_path / "ckpts"
    state = {"model": {"w": torch.zeros(1 << 20)}}  # 4 MiB
    monkeypatch.setattr(_space, "free_bytes", lambda folder: 5 << 20)  # not the 4 MiB + 1.25 MiB for metadata
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.save_checkpoint(d, 3, state, {}, {}, keep_last=2)
    assert str(e.value) == (
        f"no room for the checkpoint of step 3 in {d}: it needs 4.0 MiB, the disk has 5.0 MiB free; nothing was "
        "written. Free disk space, lower keep_last or save to a larger disk"
    )
    assert not d.exists()
    # At the start of a run: keep_last + 1 checkpoints (each with its allowance for metadata: 1 MiB + 1/16) must fit.
    monkeypatch.setattr(_space, "free_bytes", lambda folder: 40 << 20)
    one, needed = ckpt.check_room_for_run(d, state, keep_last=2)
    assert one == 4 << 20 and needed == 3 * (5 << 20) + 3 * (1 << 18)
    with pytest.raises(CheckpointSaveError) as e:
        ckpt.check_room_for_run(d, state, keep_last=7)
    assert str(e.value) == (
        f"not enough disk space for this run's checkpoints in {d}: keep_last 7 + 1 being written need 42.0 MiB "
        "(5.2 MiB each with its metadata; the folder's checkpoints hold 0.0 MiB), the disk has 40.0 MiB free; nothing "
        "was written. Free disk space, lower keep_last or save to a larger disk"
    )
    # A large checkpoint's allowance stops at 64 MiB.
    assert _space.metadata_allowance(100 << 30) == _space.METADATA_ALLOWANCE == 64 << 20


def test_small_files_are_json_and_tensors_and_older_checkpoints_still_load(world_of_one, tmp_path):
    state = {"model": {"w": torch.ones(4)}}
    with pytest.raises(CheckpointSaveError, match="rank_state holds tensors only"):
        ckpt.save_checkpoint(tmp_path, 1, state, {}, {"seed": 3}, keep_last=1)
    with pytest.raises(CheckpointSaveError, match="extra must be JSON-serialisable"):
        ckpt.save_checkpoint(tmp_path, 1, state, {"when": object()}, {}, keep_last=1)
    path = _save(tmp_path, 2)
    # A checkpoint as moeshard-train 0.3 wrote it: extra.pt, a pickle of plain values.
    (path / "extra.json").unlink()
    torch.save({"step": 2, "scheduler": {"last_epoch": 2, "_last_lr": [0.1]}}, path / "extra.pt")
    marker = json.loads((path / "COMPLETE").read_text())
    marker["files"] = {k: v for k, v in marker["files"].items() if k != "extra.json"}
    (path / "COMPLETE").write_text(json.dumps(marker))
    ckpt.validate_checkpoint(path)
    extra, rank_state = ckpt.load_checkpoint(path, {"model": {"w": torch.zeros(4)}})
    assert extra["scheduler"]["_last_lr"] == [0.1] and rank_state["rng"].item() == 2
    # An extra.pt that would run code on load is refused (weights_only), in one line.
    torch.save({"step": 2, "payload": _Evil()}, path / "extra.pt")
    with pytest.raises(ValueError, match=r"extra.pt is unreadable \(UnpicklingError"):
        ckpt.read_extra(path)


class _Evil:
    def __reduce__(self):
        return (print, ("ran code from a checkpoint",))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate_shard", "__0_0.distcp has {n} bytes, COMPLETE recorded {size}"),
        ("delete_shard", "__0_0.distcp is missing (COMPLETE records it)"),
        ("delete_metadata", ".metadata is missing (COMPLETE records it)"),
        ("garbage_metadata", ".metadata has 7 bytes, COMPLETE recorded"),
        ("old_marker_truncated_shard", "__0_0.distcp has {n} bytes, .metadata reads up to byte"),
        ("old_marker_garbage_metadata", ".metadata is unreadable (UnpicklingError"),
        ("truncated_marker", "COMPLETE is unreadable (JSONDecodeError"),
    ],
)
def test_validation_names_the_damaged_file(world_of_one, tmp_path, damage, needle):
    state = {"model": {"w": torch.arange(64.0)}}
    path = ckpt.save_checkpoint(tmp_path, 2, state, {"step": 2}, {}, keep_last=2, options=ckpt.SaveOptions(1)).path
    ckpt.validate_checkpoint(path)
    shard, marker = path / "__0_0.distcp", path / "COMPLETE"
    size = shard.stat().st_size
    if damage.startswith("old_marker"):  # checkpoints written before COMPLETE recorded the files
        record = json.loads(marker.read_text())
        del record["files"]
        marker.write_text(json.dumps(record))
    if damage.endswith("truncate_shard") or damage.endswith("truncated_shard"):
        shard.write_bytes(shard.read_bytes()[: size // 2])
    elif damage == "delete_shard":
        shard.unlink()
    elif damage == "delete_metadata":
        (path / ".metadata").unlink()
    elif damage.endswith("garbage_metadata"):
        (path / ".metadata").write_bytes(b"garbage")
    elif damage == "truncated_marker":
        marker.write_text(marker.read_text()[:20])
    with pytest.raises(ValueError) as e:
        ckpt.validate_checkpoint(path)
    assert str(e.value).startswith(f"checkpoint {path} is damaged: ")
    assert needle.format(n=size // 2, size=size) in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_rate_text_says_a_small_checkpoints_rate_in_mb_per_s(tmp_path):
    from moeshard.checkpoint import Saved

    def saved(nbytes: int, write_s: float) -> Saved:
        return Saved(tmp_path, 1, nbytes, blocking_s=0.0, staging_s=0.0, write_s=write_s)

    assert saved(2_500_000_000, 1.0).rate_text == "2.50 GB/s"
    assert saved(12_300_000, 1.0).rate_text == "12.3 MB/s"  # not 0.01 GB/s
    assert saved(100, 0.0).rate_text == "-"
