"""One job per output directory: ``<output_dir>/job.lock`` names the job that holds it.

The lock is a JSON file (``host``, ``pid``, ``pid_start``, ``started``, ``run_id``: torchrun's
``TORCHELASTIC_RUN_ID``) created atomically by rank 0 (written aside, then hard-linked into place, which fails if
the name exists). Rank 0 tells the other ranks whether it got the lock through one all-reduce at start, so a job's
own ranks are never refused and every rank of a refused job stops alike.

A held lock refuses a second job with one line naming the holder. A lock whose holder is gone is taken over, said in
one line: on the same host, its pid is gone (or names another process now: its start time differs), or it was
left by an earlier attempt of this very job (the same torchrun run id, ``--rdzv-id``: a restart, a requeued SLURM
job). A holder on another host that is not this job is never presumed dead: the refusal names the file to delete.
The refusals speak of ``logging.output_dir``, the key that names the folder in moeshard-train's config.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeshard.checkpoint._errors import CheckpointError

LOCK_FILE = "job.lock"


def _proc_start(pid: int) -> str | None:
    """The process's start time since boot (Linux ``/proc``), telling a reused pid from the holder; else None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _proc_start(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "run_id": os.environ.get("TORCHELASTIC_RUN_ID") or None,
    }


def _alive(pid: int, pid_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    now = _proc_start(pid)
    return pid_start is None or now is None or now == pid_start


def _gone(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why the holder no longer runs (None: it may)."""
    if holder.get("host") == me["host"]:
        if holder.get("pid") == me["pid"]:
            return "left by this process"
        if not _alive(int(holder.get("pid", -1)), holder.get("pid_start")):
            return f"pid {holder.get('pid')} is gone"
    run_id = holder.get("run_id")
    if run_id and run_id != "none" and run_id == me["run_id"]:  # torchrun's default --rdzv-id is "none"
        return f"an earlier attempt of this job (torchrun run id {run_id})"
    return None


def _describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}"


def _create(path: Path, me: dict[str, Any]) -> bytes:
    """Create the lock with its whole content at once; FileExistsError if it exists."""
    content = json.dumps(me).encode()
    aside = path.with_name(f".{path.name}.{me['pid']}")
    aside.write_bytes(content)
    try:
        os.link(aside, path)
    finally:
        aside.unlink(missing_ok=True)
    return content


def take(output_dir: Path) -> tuple[str | None, str | None]:
    """Rank 0: take ``<output_dir>/job.lock``. Returns ``(refusal, note)``: a one-line refusal when another job
    holds it, else None and a note when a gone holder's lock was taken over."""
    path = output_dir / LOCK_FILE
    me = _me()
    output_dir.mkdir(parents=True, exist_ok=True)
    note = None
    for _ in range(5):  # a contender may create or take over the lock between our steps: look again
        try:
            _create(path, me)
            return None, note
        except FileExistsError:
            pass
        try:
            stale = path.read_bytes()
            holder = json.loads(stale)
        except FileNotFoundError:
            continue
        except ValueError:
            return (
                f"the lock file {path} is unreadable; if no job uses logging.output_dir {output_dir}, delete it",
                None,
            )
        why = _gone(holder, me)
        if why is None:
            return (
                f"logging.output_dir {output_dir} is in use by another job ({_describe(holder)}; lock file {path}); "
                "nothing was written. Wait for it to end or choose another logging.output_dir (if that job is gone, "
                "delete the lock file)"
            ), None
        # Take over: move the stale lock away (only one contender can), check that it was the one judged stale.
        moved = path.with_name(f".{path.name}.stale-{me['pid']}")
        try:
            os.rename(path, moved)
        except FileNotFoundError:
            continue
        if moved.read_bytes() != stale:  # another job's fresh lock: put it back
            try:
                os.link(moved, path)
            except FileExistsError:
                pass
            moved.unlink()
            continue
        moved.unlink()
        note = f"took over the lock {path} of a job that is gone ({_describe(holder)}: {why})"
    return f"could not take the lock {path}: other jobs keep taking it; choose another logging.output_dir", None


def release(output_dir: Path, created: list[Path] = ()) -> None:
    """Rank 0: remove the lock if this process holds it, then the folders ``created`` (deepest first) for it that
    stayed empty (a job that failed before writing anything leaves nothing behind)."""
    path = output_dir / LOCK_FILE
    try:
        holder = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return
    if holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # not empty: the job wrote there
            break


class OutputLock:
    """One job per output directory, for every rank of a job (a context manager; needs the process group).

    Raises:
        CheckpointError: on every rank alike when another job holds the lock (rank 0 prints the holder).
    """

    def __init__(self, output_dir: Path, device: torch.device) -> None:
        self.output_dir, self.device = output_dir, device
        self.held = False
        self.created: list[Path] = []

    def __enter__(self) -> OutputLock:
        refusal, note = None, None
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            folder = self.output_dir.absolute()
            while not folder.exists():  # the folders the lock creates, removed again if the job writes nothing
                self.created.append(folder)
                folder = folder.parent
            try:
                refusal, note = take(self.output_dir)
            except OSError as e:
                refusal = f"cannot create the lock file in logging.output_dir {self.output_dir}: {e}"
            if note:
                print(note, flush=True)
        refused = torch.tensor([0 if refusal is None else 1], device=self.device)
        dist.all_reduce(refused)  # once per run: the other ranks follow rank 0's verdict
        if refused.item():
            raise CheckpointError(refusal or "logging.output_dir is in use by another job (rank 0 names it)")
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.held and self.rank0:
            release(self.output_dir, self.created)
        self.held = False
