"""Preemption: SIGTERM or SIGUSR1 stop the job after the current step, with a complete checkpoint of that step.

A cluster takes a job back by signalling it: SLURM sends a chosen signal ahead of the time limit
(``--signal=USR1@SECONDS``) and SIGTERM before a kill; torchrun forwards SIGTERM (SIGUSR1 too with
``--signals-to-handle``) to its workers. Here a signal only records itself (:class:`StopOnSignal`); the loop adds
the record to the step's loss all-reduce (``train.run(stop_requested=...)``), so every rank stops after the same
step, whichever rank got the signal and whenever. That step is saved (``Checkpointer``), rank 0 prints one line and
writes ``<output_dir>/preempted.json`` (for a batch script: requeue), and the process exits with
:data:`EXIT_STATUS`. The same command resumes at the next step. More signals while stopping change nothing; a kill
during the save leaves the previous checkpoint (saves are atomic).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# sysexits.h EX_TEMPFAIL, "a temporary failure; try again": the job stopped on request after saving its last step.
EXIT_STATUS = 75
MARKER = "preempted.json"


class StopOnSignal:
    """While active (a context manager), SIGTERM and SIGUSR1 are recorded instead of ending the process.

    Installed from the main thread only (Python runs handlers there); elsewhere the signals keep their handlers.
    On exit the previous handlers come back.
    """

    def __init__(self) -> None:
        self.received: str | None = None  # the first signal's name
        self._previous: dict[int, object] = {}

    def requested(self) -> bool:
        """Whether this rank received a stop signal (its vote for the next step's all-reduce)."""
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in progress finishes, printing here could interleave with the loop's own output.
        if self.received is None:
            self.received = signal.Signals(signum).name

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def write_marker(output_dir: Path, record: dict) -> None:
    """Rank 0, after the save: ``preempted.json`` says the job stopped on a signal and where it resumes."""
    (output_dir / MARKER).write_text(json.dumps({**record, "time": time.time()}, indent=1))


def clear_marker(output_dir: Path) -> None:
    """Rank 0, when a run starts: an earlier stop's marker no longer applies."""
    (output_dir / MARKER).unlink(missing_ok=True)
