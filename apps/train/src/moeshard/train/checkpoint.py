"""Atomic, layout-independent training checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint ``<dir>/step_00000120/`` becomes visible only when complete on every rank: all ranks write into
``<dir>/.tmp-step_00000120/``; after a barrier rank 0 writes ``COMPLETE`` and renames the folder. ``resume: auto``
takes the newest folder that has ``COMPLETE``; pruning (``keep_last``) deletes only older complete checkpoints and
our own stale temporary folders, never the newest complete one and never anything else in the directory.
A failed save (e.g. a full disk) on any rank removes the temporary folder and raises
:class:`~moeshard.train.errors.CheckpointSaveError` on every rank; the previous checkpoint is untouched. A rank
killed while saving leaves only a ``.tmp-`` folder, which ``resume: auto`` ignores and a later save replaces.

``COMPLETE`` records every file of the checkpoint with its size. Before a resume :func:`validate_checkpoint` checks
them, ``.metadata`` (readable, and every shard file it names present and long enough) and ``extra.pt``;
:func:`find_resume` with ``auto`` skips a damaged checkpoint for the newest one that validates, and
:func:`set_aside` renames the damaged one to ``step_XXXXXXXX.damaged`` (kept for inspection, never deleted; no
longer a candidate for resume, pruning or a later save of the same step).

``checkpoint.async``: ``moeshard.train.checkpoint_async`` writes the same folder in the background (DCP's
``async_save``, pinned staging on CUDA) and publishes it (``COMPLETE``, rename) only once the write ended on every
rank; a failed background write is never published and stops the job at the next save or the run's end.

:func:`save_job` / :func:`resume_job` put a training job (model, optimizer, scheduler, step, RNG) into and out of
such a folder; :class:`Checkpointer` is the training loop's callback that saves every ``checkpoint.every_steps``
(and writes the Hub folders of ``checkpoint.save_hf``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from moeshard.train.errors import CheckpointSaveError, JobError
from moeshard.train.run import Callback, Job, StepStats, lr_at

COMPLETE = "COMPLETE"
_NAME = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^\.tmp-step_(\d{8})$")
_OLD = re.compile(r"^\.old-step_(\d{8})$")


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
    if not marker.is_file():
        raise ValueError(
            f"{path} is not a complete checkpoint (no {COMPLETE} marker): it was interrupted while saving; "
            "resume from an older one or use checkpoint.resume=auto"
        )
    return json.loads(marker.read_text())


def validate_checkpoint(path: Path) -> None:
    """Check a complete checkpoint's files before loading it.

    ``COMPLETE`` is readable and every file it records is there with the recorded size (checkpoints written
    before that record have none); ``.metadata`` is readable and every shard file it names is there and long
    enough for the ranges it reads; ``extra.pt`` is there.

    Raises:
        ValueError: one line, ``checkpoint <path> is damaged: <file> ...``, naming the first damaged file (or
            that the folder is not a complete moeshard-train checkpoint).
    """
    from torch.distributed.checkpoint import FileSystemReader

    def damaged(what: str) -> ValueError:
        return ValueError(f"checkpoint {path} is damaged: {what}")

    if not (path / COMPLETE).is_file():
        read_marker(path)  # raises: not complete
    try:
        marker = json.loads((path / COMPLETE).read_text())
        recorded = dict(marker.get("files") or {})
    except (ValueError, OSError, AttributeError, TypeError) as e:
        raise damaged(f"{COMPLETE} is unreadable ({type(e).__name__}: {e})") from None
    for name, size in sorted(recorded.items()):
        f = path / name
        if not f.is_file():
            raise damaged(f"{name} is missing ({COMPLETE} records it)")
        if f.stat().st_size != size:
            raise damaged(f"{name} has {f.stat().st_size} bytes, {COMPLETE} recorded {size}")
    if not (path / ".metadata").is_file():
        raise damaged(".metadata is missing")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - a pickle of any damage raises anything
        raise damaged(f".metadata is unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    for name, end in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise damaged(f"{name} is missing (.metadata names it)")
        if f.stat().st_size < end:
            raise damaged(f"{name} has {f.stat().st_size} bytes, .metadata reads up to byte {end}")
    if not (path / "extra.pt").is_file():
        raise ValueError(
            f"{path} has no extra.pt: it is not a moeshard-train checkpoint; point checkpoint.resume elsewhere"
        )


def find_resume(resume: str, ckpt_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint ``checkpoint.resume`` (``auto``, ``none`` or a folder) names, validated before any load.

    Returns:
        ``(checkpoint or None, [(damaged checkpoint, why), ...])``: with ``auto`` the newest complete checkpoint
        that validates, and the newer ones skipped as damaged (left in place: :func:`set_aside` is the caller's).

    Raises:
        ValueError: an explicit folder that is missing, incomplete or damaged; ``auto`` when every complete
            checkpoint is damaged (starting over would hide them).
    """
    if resume == "none":
        return None, []
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ValueError(f"checkpoint.resume {path} does not exist; use auto, none or a checkpoint folder")
        try:
            validate_checkpoint(path)
        except ValueError as e:
            raise ValueError(f"{e}; resume another checkpoint (auto: the newest that validates)") from None
        return path, []
    damaged: list[tuple[Path, str]] = []
    for path in reversed(complete_checkpoints(ckpt_dir)):
        try:
            validate_checkpoint(path)
        except ValueError as e:
            damaged.append((path, str(e)))
            continue
        return path, damaged
    if damaged:
        raise ValueError(
            f"every checkpoint in {ckpt_dir} is damaged (the newest: {damaged[0][1].split(': ', 1)[1]}); nothing "
            "was changed. Restore or move them away to start over, or point checkpoint.resume at a good copy"
        )
    return None, []


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (kept, never deleted): resume, pruning and a later save of
    the same step no longer see it. Returns the new path."""
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged{n}")
    os.rename(path, target)
    return target


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
    rank_state: dict[str, Any],
    *,
    keep_last: int,
    writer_factory: Callable[[Path, int], StorageWriter] | None = None,
) -> Path:
    """Save atomically on every rank; returns the final folder.

    Args:
        app_state: DCP-ready state (``{"model": ..., "optim": ...}`` with DTensors), saved layout-independently.
        extra: small picklable state shared by all ranks (scheduler, step, config), written by rank 0.
        rank_state: per-rank picklable state (RNG), one file per rank.
        keep_last: complete checkpoints to keep after this one is written.
        writer_factory: ``(folder, step) -> StorageWriter`` for DCP (e.g. ``Faults.storage_writer``); None: a
            plain ``FileSystemWriter``.
    """
    tmp = _begin(ckpt_dir, step)
    error = None
    try:
        writer = (writer_factory or _file_system_writer)(tmp, step)
        dcp.save(app_state, storage_writer=writer)
        _write_small(tmp, extra, rank_state)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = e
    _raise_if_any_failed(ckpt_dir, tmp, step, error)
    if dist.get_rank() == 0:
        _publish(ckpt_dir, tmp, step, keep_last)
    dist.barrier()
    return ckpt_dir / checkpoint_name(step)


def _file_system_writer(path: Path, step: int) -> StorageWriter:
    return dcp.FileSystemWriter(str(path))


def _begin(ckpt_dir: Path, step: int) -> Path:
    """The temporary folder of a save, made empty by rank 0 before any rank writes into it."""
    tmp = ckpt_dir / f".tmp-{checkpoint_name(step)}"
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a stale attempt of ours at this step
        tmp.mkdir()
    dist.barrier()
    return tmp


def _write_small(tmp: Path, extra: dict[str, Any], rank_state: dict[str, Any]) -> None:
    rank = dist.get_rank()
    torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        torch.save(extra, tmp / "extra.pt")


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
    previous = newest_checkpoint(ckpt_dir)
    raise CheckpointSaveError(
        f"saving the checkpoint of step {step}{how} failed"
        + (f" ({describe_failure(error)})" if error is not None else f" on {int(failed.item())} other rank(s)")
        + f"; nothing was published, the previous checkpoint {previous or '(none)'} is intact. "
        "Free disk space or point checkpoint.dir elsewhere, then resume"
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


def load_checkpoint(path: Path, app_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load DCP state in place (any layout); returns ``(extra, this rank's rank_state or None)``."""
    marker = read_marker(path)
    if not (path / "extra.pt").is_file():
        raise ValueError(
            f"{path} has no extra.pt: it is not a moeshard-train checkpoint; point checkpoint.resume elsewhere"
        )
    advice = "its files may be damaged: resume an older checkpoint with checkpoint.resume=<folder>"
    try:
        dcp.load(app_state, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException; DCP raises it on every rank with every rank's failure
        raise JobError(f"checkpoint {path} could not be loaded ({describe_failure(e)}); {advice}") from e
    try:
        extra = torch.load(path / "extra.pt", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything
        raise JobError(f"checkpoint {path}: extra.pt is unreadable ({describe_failure(e)}); {advice}") from e
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    same_world = marker.get("world_size") == dist.get_world_size()  # else the per-rank files do not map
    try:
        rank_state = torch.load(rank_file, weights_only=False) if same_world and rank_file.is_file() else None
    except Exception as e:  # noqa: BLE001 - this rank's file only: the other ranks may not fail
        msg = f"checkpoint {path}: {rank_file.name} is unreadable ({describe_failure(e)}); {advice}"
        raise JobError(msg, every_rank=False) from e
    return extra, rank_state


# ---- a training job in a checkpoint ------------------------------------------------------------------------------


def app_state(job: Job) -> dict[str, Any]:
    """Model and optimizer state for DCP (layout independent, see ``moeshard.fsdp_moe.get_state_dict``)."""
    from moeshard.fsdp_moe import get_state_dict

    return get_state_dict(job.model, job.optimizer)


def job_state(job: Job, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """What a checkpoint after ``step`` steps holds: ``(DCP state, extra, this rank's state)`` (model, optimizer;
    scheduler, step, config, data position; RNG)."""
    config = job.cfg.to_dict()
    if config["data"].get("tokenizer"):  # absolute, as in run.json: an export from another folder still finds it
        config["data"]["tokenizer"] = os.path.abspath(os.path.expanduser(config["data"]["tokenizer"]))
    extra = {
        "step": step,
        "scheduler": job.scheduler.state_dict(),
        "world_size": dist.get_world_size(),
        "config": config,
        "model_config": job.model_config.to_dict(),
        # The data order is a pure function of the step (moeshard.data.StepBatches), so the step is the position.
        "data": {"step": step, "samples_seen": step * job.cfg.train.global_batch_size},
    }
    rank_state = {"cpu_rng": torch.get_rng_state()}
    if job.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(job.device)
    return app_state(job), extra, rank_state


def save_job(
    job: Job, ckpt_dir: Path, step: int, writer_factory: Callable[[Path, int], StorageWriter] | None = None
) -> Path:
    """Save an atomic, layout-independent checkpoint after ``step`` steps (model, optimizer, scheduler, data
    position, RNG); returns its folder."""
    keep = job.cfg.checkpoint.keep_last
    return save_checkpoint(ckpt_dir, step, *job_state(job, step), keep_last=keep, writer_factory=writer_factory)


def write_hub_folder(checkpoint: Path, hf_dir: Path, dtype: str) -> Path:
    """``checkpoint.save_hf``: the Hub folder ``hf_dir/<checkpoint's name>`` written from a complete checkpoint by
    :func:`moeshard.train.commands.export.export_hf` (streaming: host memory bounded by a shard), atomically (a temporary
    folder renamed; an earlier folder of the same step is replaced). Returns the folder."""
    from moeshard.train.commands.export import export_hf

    final, tmp = hf_dir / checkpoint.name, hf_dir / f".tmp-{checkpoint.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(checkpoint, tmp, dtype=dtype)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def resume_job(job: Job, path: Path) -> int:
    """Load a checkpoint of any layout into the job; returns the step it was taken after."""
    from moeshard.fsdp_moe import set_state_dict

    state = app_state(job)
    extra, rank_state = load_checkpoint(path, state)
    set_state_dict(job.model, state, job.optimizer)
    step = int(extra["step"])
    # The schedule is a function of the step (the saved scheduler state has one entry per parameter group, and the
    # groups depend on the layout: experts outside FSDP have an optimizer of their own). train.steps may have
    # changed: the schedule of this run decides.
    job.scheduler.last_epoch = step
    lr = lr_at(step, job.cfg)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    if rank_state is not None:  # same world size: each rank continues its own random stream
        torch.set_rng_state(rank_state["cpu_rng"])
        if "cuda_rng" in rank_state and job.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"], job.device)
    return step


class Checkpointer(Callback):
    """Saves the job after every ``checkpoint.every_steps`` steps, after the last one (``save_final``, or
    ``save_hf`` other than ``none``) and after a step the ranks agreed to stop at (``StepStats.stop_agreed``: a
    preemption).

    ``checkpoint.async``: every save but the run's last runs in the background (``checkpoint_async``). The loop
    goes on at once (on CUDA the copy to pinned host memory overlaps the next step's forward and backward; its
    optimizer step waits for the copy); rank 0 publishes the checkpoint (``COMPLETE``, rename) at the first step
    end after the write ended on every rank; the next save and the end of the run wait for it, and a failed write
    stops the job there (:class:`CheckpointSaveError`), never published. ``checkpoint.save_hf``: rank 0 writes the
    Hub folder ``<output_dir>/hf/step_XXXXXXXX`` (:func:`write_hub_folder`) from every published checkpoint
    (``every``) or from the last step's (``final``); the other ranks wait for it at their next collective.

    Args:
        console: where rank 0's lines go (the progress bar's ``write``); ``print`` by default.
        writer_factory: the saves' DCP storage writers (``Faults.storage_writer``); None: plain ones.
    """

    def __init__(
        self,
        job: Job,
        ckpt_dir: Path,
        console: Callable[[str], None] | None = None,
        writer_factory: Callable[[Path, int], StorageWriter] | None = None,
    ) -> None:
        self.job, self.ckpt_dir, self.writer_factory = job, ckpt_dir, writer_factory
        self.console = console or functools.partial(print, flush=True)
        self.last_saved = newest_checkpoint(ckpt_dir)
        self.pending = None  # a moeshard.train.checkpoint_async.PendingSave
        self._started: dict[int, tuple[float, bool]] = {}  # step -> (save began, in the background)
        self._group = None
        if job.cfg.checkpoint.async_:
            # A background save's collectives run on a gloo group of their own (made by every rank, here): on the
            # training's group they would interleave with the steps'.
            self._group = dist.new_group(backend="gloo")

    def due(self, step: int) -> bool:
        """Whether the loop saves after ``step``."""
        c = self.job.cfg.checkpoint
        last = step == self.job.cfg.train.steps and (c.save_final or c.save_hf != "none")
        return bool(c.every_steps and step % c.every_steps == 0) or last

    def before_update(self, step: int, stats: StepStats) -> None:
        if self.pending is not None:
            self.pending.wait_staged()  # the optimizer step is about to change the state being copied

    def on_step_end(self, step: int, stats: StepStats) -> None:
        save = self.due(step) or stats.stop_agreed  # the ranks stop after this step (preemption): save it
        last = step == self.job.cfg.train.steps or stats.stop_agreed
        if self.pending is not None and (save or last):  # every rank, at the same step
            pending, self.pending = self.pending, None
            announced = pending.published is not None  # rank 0 published it at an earlier step end
            path = pending.wait()
            if not announced:
                self._published(path, pending.step)
        elif self.pending is not None and dist.get_rank() == 0 and self.pending.published is None:
            if self.pending.publish_if_done() is not None:
                self._published(self.pending.published, self.pending.step)
        if not save:
            return
        self._started[step] = (time.perf_counter(), self._group is not None and not last)
        if self._group is not None and not last:
            from moeshard.train.checkpoint_async import make_stager, start_async_save

            keep = self.job.cfg.checkpoint.keep_last
            # A stager per save: torch 2.11's async_save closes the stager it was given once the save ends (seen on
            # an H200: the next save with the same stager failed in its staging), so none is reused.
            stager = make_stager(self.job.device)
            self.pending = start_async_save(
                self.ckpt_dir,
                step,
                *job_state(self.job, step),
                keep_last=keep,
                group=self._group,
                stager=stager,
                writer_factory=self.writer_factory,
            )
        else:
            self._published(save_job(self.job, self.ckpt_dir, step, self.writer_factory), step)

    def _published(self, path: Path, step: int) -> None:
        self.last_saved = path
        c = self.job.cfg.checkpoint
        started, background = self._started.pop(step, (None, False))
        if dist.get_rank() == 0 and started is not None:  # one line per saved checkpoint: step, size, seconds
            size = sum(read_marker(path).get("files", {}).values())
            seconds = f"{time.perf_counter() - started:.1f} s{' in the background' if background else ''}"
            size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
            self.console(f"checkpoint of step {step}: {path} ({size_text}, {seconds})")
        if dist.get_rank() == 0 and (
            c.save_hf == "every" or (c.save_hf == "final" and step == self.job.cfg.train.steps)
        ):
            try:
                hub = write_hub_folder(path, Path(self.job.cfg.logging.output_dir) / "hf", c.hf_dtype)
            except (OSError, ValueError) as e:  # e.g. a full disk; rank 0 only: the others stop on losing it
                raise JobError(
                    f"writing the Hub folder of step {step} failed ({describe_failure(e)}); the checkpoint {path} is "
                    "complete: resume from it, or export it later with moeshard-train export-hf",
                    every_rank=False,
                ) from e
            self.console(f"Hub folder {hub} written from checkpoint {path.name} ({c.hf_dtype})")

    def on_run_end(self) -> None:
        """After an error in the loop (a run that ends well waited at its last step): a background save still
        ends (each rank waits for its own write, no collective), rank 0 publishes it if it succeeded."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.upload.result()
                if dist.get_rank() == 0:
                    pending.publish_if_done()
            except BaseException:  # noqa: BLE001 - the loop's own error is the one reported
                if dist.get_rank() == 0:
                    shutil.rmtree(pending.tmp, ignore_errors=True)
            finally:
                pending.close_stager()
