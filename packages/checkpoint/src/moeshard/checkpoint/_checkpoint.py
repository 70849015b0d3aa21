"""Atomic, validated checkpoint folders of a parallel job with torch.distributed.checkpoint (DCP).

A checkpoint ``<dir>/step_00000120/`` becomes visible only when complete on every rank: all ranks write into
``<dir>/.tmp-step_00000120/``; after the ranks agree that every write succeeded, rank 0 writes ``COMPLETE`` and
renames the folder. :func:`find_resume` with ``auto`` takes the newest folder that has ``COMPLETE`` and validates;
pruning (``keep_last``) deletes only older complete checkpoints and our own stale temporary folders, never the
newest complete one and never anything else in the directory. A failed save (e.g. a full disk) on any rank
removes the temporary folder and raises :class:`CheckpointSaveError` on every rank, naming the step that failed
and the previous checkpoint, which is untouched. A rank killed while saving leaves only a ``.tmp-`` folder, which
``auto`` ignores and a later save replaces. Before anything is written the save's size (every rank's bytes) is
checked against the free space (:mod:`moeshard.checkpoint._space`).

``COMPLETE`` records every file of the checkpoint with its size, for ``validate_checkpoint`` before a resume
(``moeshard.checkpoint._resume``: validation, the choice of a checkpoint, loading it).

Files: DCP's ``.metadata`` (a pickle: load only your own checkpoints) and ``__<rank>_<i>.distcp`` shards (several
per rank: ``SaveOptions.thread_count`` writer threads); ``extra.json`` (rank 0: the small state every rank shares)
and ``rank_<r>.pt`` (tensors only, loaded with ``weights_only=True``). Checkpoints of moeshard-train 0.3 hold
``extra.pt`` instead of ``extra.json``; it is still read, with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from moeshard.checkpoint._errors import CheckpointSaveError
from moeshard.checkpoint._space import agree_sizes, check_room_for_save, human, metadata_allowance
from moeshard.checkpoint._stage import Stager, state_bytes
from moeshard.fsdp_moe import joined_masters

WriterFactory = Callable[[Path, int], StorageWriter]

COMPLETE = "COMPLETE"
"""The marker file rank 0 writes last: a checkpoint folder with it is complete (it records every file's size)."""
_NAME = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^\.tmp-step_(\d{8})$")
_OLD = re.compile(r"^\.old-step_(\d{8})$")
EXTRA_JSON, EXTRA_LEGACY = "extra.json", "extra.pt"


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes (DCP's ``FileSystemWriter`` options).

    Args:
        thread_count: writer threads per rank, each writing a file of its own (several files per rank: a single
            stream does not reach a fast disk's rate).
        sync_files: fsync every file before the checkpoint is published.
    """

    thread_count: int = 8
    sync_files: bool = True

    def __post_init__(self) -> None:
        if self.thread_count < 1:
            raise ValueError(f"SaveOptions.thread_count must be >= 1, got {self.thread_count}")

    def writer(self, path: Path, step: int) -> StorageWriter:
        """The package's own writer for the checkpoint of ``step`` in ``path`` (a ``writer_factory``)."""
        return FileSystemWriter(
            str(path), single_file_per_rank=True, sync_files=self.sync_files, thread_count=self.thread_count
        )


DEFAULT_SAVE_OPTIONS = SaveOptions()


@dataclass(frozen=True)
class Saved:
    """What one save did, on this rank: where, how much and how long.

    ``blocking_s``: time the caller's thread was held by the save (for a background save: starting it);
    ``staging_s``: the copy of the state to host memory; ``write_s``: writing the staged state (for a background
    save: in the background); ``bytes``: this rank's state.
    """

    path: Path
    step: int
    bytes: int
    blocking_s: float
    staging_s: float
    write_s: float

    @property
    def gb_per_s(self) -> float:
        """This rank's write rate (10^9 bytes per second)."""
        return self.bytes / 1e9 / self.write_s if self.write_s > 0 else float("nan")

    @property
    def rate_text(self) -> str:
        """This rank's write rate for a log line: in GB/s with two decimals, in MB/s below a tenth of a GB/s (where
        two decimals of GB/s would read as zero), ``"-"`` when the write took no measurable time."""
        if not self.write_s > 0:
            return "-"
        gb = self.gb_per_s
        return f"{gb:.2f} GB/s" if gb >= 0.1 else f"{gb * 1e3:.1f} MB/s"


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step_{step:08d}"


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _NAME.match(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(ckpt_dir)
    return done[-1] if done else None


def read_marker(path: Path) -> dict[str, Any]:
    """The JSON content of a checkpoint's ``COMPLETE`` marker."""
    marker = path / COMPLETE
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist; give a checkpoint folder (step_XXXXXXXX)")
    if not marker.is_file():
        raise ValueError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker): it was interrupted while saving; "
            "use an older one (to resume: or checkpoint.resume=auto, which takes the newest complete one)"
        )
    return json.loads(marker.read_text())


def check_room_for_run(
    folder: Path, state: dict[str, Any], keep_last: int, group: dist.ProcessGroup | None = None
) -> tuple[int, int]:
    """At the start of a run (after the optimizer's first step, see ``model_state``): room for ``keep_last``
    checkpoints plus the one being written, counting what the complete checkpoints already in ``folder`` hold
    (pruning frees them as newer ones arrive; :mod:`moeshard.checkpoint._space` has the figures).

    Returns:
        ``(bytes of one checkpoint, bytes still needed)``.

    Raises:
        CheckpointSaveError: on every rank alike, one line naming both figures and the fix, before any write.
    """
    one, free = agree_sizes(folder, state, group)
    held = 0
    for path in complete_checkpoints(folder):
        try:
            held += sum(read_marker(path).get("files", {}).values())
        except ValueError:
            continue
    each = one + metadata_allowance(one)
    steady = (max(1, keep_last) + 1) * each
    needed = max(each, steady - held)
    if needed > free:
        raise CheckpointSaveError(
            f"not enough disk space for this run's checkpoints in {folder}: keep_last {keep_last} + 1 being written "
            f"need {human(steady)} ({human(each)} each with its metadata; the folder's checkpoints hold "
            f"{human(held)}), the disk has "
            f"{human(free)} free; nothing was written. Free disk space, lower keep_last or save to a larger disk"
        )
    return one, needed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    app_state: dict[str, Any],
    extra: dict[str, Any],
    rank_state: dict[str, torch.Tensor],
    *,
    keep_last: int,
    stager: Stager | None = None,
    options: SaveOptions = DEFAULT_SAVE_OPTIONS,
    writer_factory: WriterFactory | None = None,
) -> Saved:
    """Save atomically on every rank (every rank calls it); returns what this rank's save did.

    Args:
        app_state: DCP-ready state (``{"model": ..., "optimizer": ...}`` with DTensors, e.g. :func:`model_state`),
            saved layout-independently.
        extra: small JSON-able state shared by all ranks (scheduler, step, config), written by rank 0 as
            ``extra.json``.
        rank_state: this rank's tensors (RNG states), ``rank_<r>.pt``, read back with ``weights_only=True``.
        keep_last: complete checkpoints to keep after this one is written.
        stager: on CUDA, the job's :class:`Stager` (buffers reused across saves): the state is copied to pinned
            host memory first and written from there. Without one (or on the CPU) DCP writes the live tensors.
        options: writer threads and fsync (:class:`SaveOptions`); ignored with ``writer_factory``.
        writer_factory: ``(temporary folder, step) -> StorageWriter``; None: the package's own
            (``options.writer``).

    Raises:
        CheckpointSaveError: on every rank alike: too little free space (before any write), or a write failed on
            some rank (nothing published; the previous checkpoint is intact).
    """
    t0 = time.perf_counter()
    check_room_for_save(ckpt_dir, step, app_state)
    tmp = _begin(ckpt_dir, step)
    error, staging_s, t1 = None, 0.0, time.perf_counter()
    try:
        _write_small(tmp, extra, rank_state)
        if stager is not None and stager.cuda:
            staged = stager.stage(app_state)
            state = staged.result()
            staging_s, t1 = time.perf_counter() - t1, time.perf_counter()
        else:
            state = joined_masters(app_state)  # DCP writes tensors: split masters joined (all at once) here
        dcp.save(state, storage_writer=(writer_factory or options.writer)(tmp, step))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = e
    write_s = time.perf_counter() - t1
    _raise_if_any_failed(ckpt_dir, tmp, step, error)
    if dist.get_rank() == 0:
        _publish(ckpt_dir, tmp, step, keep_last)
    dist.barrier()
    path = ckpt_dir / checkpoint_name(step)
    return Saved(path, step, state_bytes(app_state), time.perf_counter() - t0, staging_s, write_s)


def _begin(ckpt_dir: Path, step: int, group: dist.ProcessGroup | None = None) -> Path:
    """The temporary folder of a save, made empty by rank 0 before any rank writes into it."""
    tmp = ckpt_dir / f".tmp-{checkpoint_name(step)}"
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a stale attempt of ours at this step
        tmp.mkdir()
    dist.barrier(group=group)
    return tmp


def _write_small(tmp: Path, extra: dict[str, Any], rank_state: dict[str, torch.Tensor]) -> None:
    """``rank_<r>.pt`` (tensors only) on every rank, ``extra.json`` on rank 0."""
    rank = dist.get_rank()
    bad = [k for k, v in rank_state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"rank_state holds tensors only (loaded with weights_only=True); {bad[0]!r} is not one")
    torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        try:
            text = json.dumps(extra)
        except TypeError as e:
            raise ValueError(f"extra must be JSON-serialisable (it is saved as {EXTRA_JSON}): {e}") from None
        (tmp / EXTRA_JSON).write_text(text)


def _raise_if_any_failed(ckpt_dir: Path, tmp: Path, step: int, error: BaseException | None, how: str = "") -> None:
    """Agree on the outcome of a save (one all-reduce); when any rank failed, rank 0 removes the temporary folder
    and every rank raises :class:`CheckpointSaveError`."""
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed)
    if not failed.item():
        return
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    # The checkpoint before this step (a folder may also hold newer ones, of an earlier run that went further).
    older = [p for p in complete_checkpoints(ckpt_dir) if int(_NAME.match(p.name).group(1)) < step]
    previous = older[-1] if older else None
    raise CheckpointSaveError(
        f"saving the checkpoint of step {step}{how} failed"
        + (f" ({describe_failure(error)})" if error is not None else f" on {int(failed.item())} other rank(s)")
        + f"; nothing was published, the previous checkpoint {previous or '(none)'} is intact. "
        "Free disk space or save elsewhere, then resume"
    ) from error


def _publish(ckpt_dir: Path, tmp: Path, step: int, keep_last: int) -> Path:
    """Rank 0, once every rank's files are written: ``COMPLETE`` (every file and its size), rename, prune."""
    final = ckpt_dir / checkpoint_name(step)
    files = {}
    for f in sorted(tmp.iterdir()):
        if f.is_file():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
            files[f.name] = f.stat().st_size
    # The record validate_checkpoint checks before a resume: every file of the checkpoint and its size.
    marker = {"step": step, "world_size": dist.get_world_size(), "time": time.time(), "files": files}
    (tmp / COMPLETE).write_text(json.dumps(marker))
    _fsync_dir(tmp)
    old = ckpt_dir / f".old-{checkpoint_name(step)}"
    if final.exists():  # an earlier save of the same step (resumed from before it): move it aside first
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # a crash from here on still leaves the older complete checkpoints
    os.rename(tmp, final)
    _fsync_dir(ckpt_dir)
    shutil.rmtree(old, ignore_errors=True)
    prune(ckpt_dir, keep_last)
    return final


def describe_failure(error: BaseException) -> str:
    """One line for a failed save or load: each failed rank's error (DCP's ``CheckpointException``, a
    ``BaseException``, reports every rank's failure to every rank), else ``Type: message``."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            for r, (exc, _) in sorted(error.failures.items())
        )
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def prune(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last`` and our stale temporary folders.

    Only ``step_XXXXXXXX`` folders holding ``COMPLETE`` and our own ``.tmp-``/``.old-`` folders are candidates;
    the newest complete checkpoint is always kept and nothing else in ``ckpt_dir`` is touched.
    """
    keep_last = max(1, keep_last)
    done = complete_checkpoints(ckpt_dir)
    removed = done[:-keep_last]
    newest_step = int(_NAME.match(done[-1].name).group(1)) if done else -1
    stale = [
        p
        for p in ckpt_dir.iterdir()
        if ((m := _TMP.match(p.name)) and int(m.group(1)) <= newest_step) or _OLD.match(p.name)
    ]
    for p in removed + stale:
        shutil.rmtree(p, ignore_errors=True)
    return removed
