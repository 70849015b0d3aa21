"""Fault injection for tests of crash safety: a testing aid, never needed (nor read) in normal runs.

Set ``MOESHARD_FAULT`` to one or more comma-separated faults; steps count from 1 like ``metrics.jsonl``:

    kill_rank:R:step:S          SIGKILL rank R in step S, after its backward, before the optimizer step
    kill_rank:R:during_save:S   SIGKILL rank R while saving the checkpoint of step S, after its shard is written
    nan_loss:R:step:S           rank R's loss of step S becomes NaN (its gradients too)
    enospc:R:during_save:S      rank R's checkpoint write of step S fails with OSError(ENOSPC)

Each fault fires once per output directory (a marker under ``<output_dir>/.faults_fired/`` is written first), so a
job restarted by ``torchrun --max-restarts`` with the same environment does not fail again. :class:`FaultInjection`
is the training loop's callback for the faults in a step; :meth:`Faults.storage_writer` serves those during a save
(the checkpoint saves' ``writer_factory``). The job builds one :class:`Faults` and hands it to both.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter

from moeshard.checkpoint import SaveOptions
from moeshard.train.run import Callback, StepStats

ENV = "MOESHARD_FAULT"
_KINDS = {"kill_rank": ("step", "during_save"), "nan_loss": ("step",), "enospc": ("during_save",)}


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``rank`` at ``where`` (``step`` or ``during_save``) of ``step``."""

    kind: str
    rank: int
    where: str
    step: int

    @property
    def name(self) -> str:
        """The spec as written, also the marker's file name."""
        return f"{self.kind}:{self.rank}:{self.where}:{self.step}"


def parse(spec: str) -> list[Fault]:
    """Parse a ``MOESHARD_FAULT`` value.

    Raises:
        ValueError: a malformed item, naming it and the accepted forms.
    """
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"(\w+):(\d+):(\w+):(\d+)", item)
        if not m or m.group(1) not in _KINDS or m.group(3) not in _KINDS[m.group(1)]:
            forms = ", ".join(f"{k}:RANK:{w}:STEP" for k, ws in _KINDS.items() for w in ws)
            raise ValueError(f"{ENV}: cannot parse {item!r}; use one of {forms}")
        faults.append(Fault(m.group(1), int(m.group(2)), m.group(3), int(m.group(4))))
    return faults


class Faults:
    """This rank's injected faults (a testing aid): built by the job, handed to what it injects into.

    The job builds it once (:meth:`from_env`, the debug variable ``MOESHARD_FAULT``, read where the job starts) and
    hands it on: :meth:`storage_writer` is the checkpoint saves' ``writer_factory``, :class:`FaultInjection` the
    loop's callback. Nothing is kept at module level.

    Args:
        faults: this rank's faults.
        marker_dir: where each fault's "fired" marker goes (``<output_dir>/.faults_fired``).
        rank: this rank (for the message).
    """

    def __init__(self, faults: list[Fault], marker_dir: Path, rank: int) -> None:
        self.faults, self.marker_dir, self.rank = list(faults), Path(marker_dir), rank

    @classmethod
    def from_env(cls, output_dir: Path, rank: int, environ: dict[str, str] | None = None) -> Faults:
        """This rank's faults of ``MOESHARD_FAULT`` (none when unset); markers under ``output_dir``.

        Raises:
            ValueError: a malformed spec (see :func:`parse`).
        """
        spec = (os.environ if environ is None else environ).get(ENV, "")
        return cls([f for f in parse(spec) if f.rank == rank], Path(output_dir) / ".faults_fired", rank)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def take(self, kind: str, where: str, step: int) -> bool:
        """True once for a matching fault of this rank; records that it fired before the caller acts."""
        for f in self.faults:
            if (f.kind, f.where, f.step) == (kind, where, step):
                marker = self.marker_dir / f.name
                if marker.exists():
                    return False
                marker.parent.mkdir(parents=True, exist_ok=True)
                with open(marker, "w") as fh:
                    fh.write("fired\n")
                    fh.flush()
                    os.fsync(fh.fileno())
                return True
        return False

    def kill(self) -> None:
        """SIGKILL this process (the fault's message first)."""
        print(f"{ENV}: killing rank {self.rank} (pid {os.getpid()}) with SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def at_step(self, step: int) -> None:
        """Called by the training loop after the backward of step ``step``."""
        if self.faults and self.take("kill_rank", "step", step):
            self.kill()

    def poison_loss(self, step: int) -> bool:
        """Whether this rank's loss of step ``step`` must become NaN."""
        return bool(self.faults) and self.take("nan_loss", "step", step)

    def storage_writer(self, path: Path, step: int) -> StorageWriter:
        """The DCP storage writer for a checkpoint of ``step`` (a save's ``writer_factory``):
        ``moeshard.checkpoint``'s own (``SaveOptions().writer``) unless a fault is due during that save."""
        options = SaveOptions()
        due = [f for f in self.faults if f.where == "during_save" and f.step == step]
        if not due:
            return options.writer(path, step)
        faults = self

        class _FaultyWriter(FileSystemWriter):
            def write_data(self, plan, planner):
                if faults.take("enospc", "during_save", step):
                    raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})", str(path))
                future = super().write_data(plan, planner)
                future.wait()  # this rank's shard is on disk; the checkpoint is not published yet
                if faults.take("kill_rank", "during_save", step):
                    faults.kill()
                return future

        return _FaultyWriter(
            str(path), single_file_per_rank=True, sync_files=options.sync_files, thread_count=options.thread_count
        )  # the package's writer options, its write_data wrapped


class FaultInjection(Callback):
    """The faults due in a step: ``nan_loss`` poisons this rank's loss in the step's forward, ``kill_rank`` kills
    the rank after the step's backward, before its optimizer step."""

    def __init__(self, model: torch.nn.Module, faults: Faults) -> None:
        self.model, self.faults = model, faults
        self._poison = None

    def on_step_start(self, step: int) -> None:
        if self.faults.poison_loss(step):
            self._poison = self.model.register_forward_hook(_nan_loss)

    def before_update(self, step: int, stats: StepStats) -> None:
        if self._poison is not None:
            self._poison.remove()
            self._poison = None
        self.faults.at_step(step)


def _nan_loss(module: torch.nn.Module, args: object, output):
    output.loss = output.loss * float("nan")
    output.lm_loss = output.lm_loss * float("nan")  # what the loop back-propagates
    return output
