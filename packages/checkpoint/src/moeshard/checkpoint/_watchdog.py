"""Hangs fail fast: a job whose steps stop ending ends itself within a timeout, naming the rank that is behind.

Every rank records the last step it finished in the job's store (``torch.distributed``'s TCPStore: under torchrun
the agent hosts it, so a stopped worker does not take it down) at each :meth:`HangWatchdog.beat`. A thread on each
rank watches the time since its own last beat; past the timeout (``init_timeout_s`` until the first beat: start-up,
compilation) every rank says in the store where its main thread is (inside a ``torch.distributed`` call or not)
and one rank, the first to claim the report, prints one line: the ranks that did not arrive and every rank's last
finished step. A rank did not arrive when its process stopped running (the liveness counter its watchdog thread
adds to every second stood still: stopped, frozen, its host gone), when the others wait in a collective and it
does not (stuck before one), or when its last finished step is behind the others'. Then every rank that still
runs exits at once (``os._exit``: its main thread may be blocked inside a collective that never returns). Nothing
that was being saved is published: publication needs every rank's agreement, which never comes; ``resume: auto``
continues from the newest complete checkpoint. A stopped worker that cannot exit by itself is ended by its
launcher: torchrun's agent sends SIGTERM to its other workers once one failed, SIGKILL 30 s later, and with
``--max-restarts`` starts them all again.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

_PREFIX = "moeshard/last_step"
_ALIVE = "moeshard/alive"
_WHERE = "moeshard/where"
_REPORTED = "moeshard/hang_reported"
_REPORT_DONE = "moeshard/hang_report_done"


class HangWatchdog:
    """Ends the job when no step ends on this rank for ``timeout_s`` (a context manager; every rank makes one).

    Args:
        timeout_s: seconds without a :meth:`beat` after the first one; must exceed a step plus what runs after it
            (a synchronous save, an evaluation). 0 disables the watchdog.
        init_timeout_s: the allowance before the first beat (the first step: start-up, compilation).
        store: where the ranks' last steps meet (the job's ``torch.distributed`` store); None: no names in the
            report, this rank's own step only.
        key: how the timeout is named in the report (the config key that sets it).
        console: where the report goes (one line).
        exit_code: the status every rank exits with when the watchdog fires.
        on_fire: called instead of exiting (tests); receives the report line.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        init_timeout_s: float = 300.0,
        store: dist.Store | None = None,
        key: str = "timeout_s",
        console: Callable[[str], None] | None = None,
        exit_code: int = 1,
        on_fire: Callable[[str], None] | None = None,
    ) -> None:
        if timeout_s < 0 or init_timeout_s < 0:
            raise ValueError(f"{key} must be >= 0 (0: off), got {timeout_s}")
        self.timeout_s, self.init_timeout_s, self.store, self.key = timeout_s, init_timeout_s, store, key
        self.console = console or (lambda line: print(line, flush=True))
        self.exit_code, self.on_fire = exit_code, on_fire
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.last_step: int | None = None
        self.settle_s = 3.0  # how long a liveness counter must stand still to call its rank stopped
        self._last_time = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HangWatchdog:
        if self.timeout_s > 0:
            self._last_time = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="moeshard-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread = None

    def beat(self, step: int) -> None:
        """This rank finished ``step`` (counted from 1)."""
        self.last_step, self._last_time = step, time.monotonic()
        if self.store is not None and self.timeout_s > 0:
            try:
                self.store.set(f"{_PREFIX}/{self.rank}", str(step))
            except Exception:  # noqa: BLE001 - the store's host may be gone: the watchdog still fires
                pass

    def _alive(self, rank: int, tick: int = 0) -> int:
        """Rank ``rank``'s liveness counter (its watchdog thread adds 1 about every second; ``tick`` 0 reads)."""
        return int(self.store.add(f"{_ALIVE}/{rank}", tick))

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 20)):
            if self.store is not None:
                try:  # this process still runs (a stopped or frozen one stops counting)
                    self._alive(self.rank, 1)
                except Exception:  # noqa: BLE001 - the store's host may be gone
                    pass
            limit = self.timeout_s if self.last_step is not None else max(self.timeout_s, self.init_timeout_s)
            idle = time.monotonic() - self._last_time
            if idle > limit:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        if self.store is not None:
            try:  # where this rank's main thread is: in a collective (waiting for a peer) or not
                self.store.set(f"{_WHERE}/{self.rank}", main_thread_location())
            except Exception:  # noqa: BLE001 - the store's host may be gone
                pass
        line: list[str] = []
        reporter = threading.Thread(target=lambda: line.append(self.report(idle)), daemon=True)
        reporter.start()
        reporter.join(timeout=self.settle_s + 10)  # a store whose host is stopped never answers: this rank alone
        text = line[0] if line else self._alone(idle)
        if text:
            self.console(text)
        if self.on_fire is not None:
            self.on_fire(text)
            return
        os._exit(self.exit_code)

    def _alone(self, idle: float) -> str:
        mine = self.last_step if self.last_step is not None else "none"
        return (
            f"no step ended on rank {self.rank} for {idle:.1f} s ({self.key} {self.timeout_s:g}); its last finished "
            f"step: {mine} (the other ranks' are unknown: the job's store does not answer); stopping the job: "
            "nothing partial is published, resume: auto continues from the newest complete checkpoint"
        )

    def _read(self, prefix: str, rank: int) -> str | None:
        k = f"{prefix}/{rank}"
        return self.store.get(k).decode() if self.store.check([k]) else None

    def report(self, idle: float) -> str:
        """The one line (empty on the ranks that leave the report to another, which keep counting until it is
        written): the ranks that did not arrive, every rank's last finished step (see :func:`describe_hang`)."""
        if self.store is None:
            return self._alone(idle)
        if int(self.store.add(_REPORTED, 1)) != 1:
            deadline = time.monotonic() + self.settle_s + 10
            while not self.store.check([_REPORT_DONE]) and time.monotonic() < deadline:
                self._alive(self.rank, 1)  # still running: not to be taken for a stopped rank
                time.sleep(0.2)
            return ""
        before = {r: self._alive(r) for r in range(self.world)}
        time.sleep(self.settle_s)  # the other ranks fire meanwhile and say where they are
        frozen = [r for r in range(self.world) if r != self.rank and self._alive(r) == before[r]]
        steps = {r: (int(v) if (v := self._read(_PREFIX, r)) is not None else None) for r in range(self.world)}
        if self.last_step is not None:
            steps[self.rank] = self.last_step
        where = {r: self._read(_WHERE, r) for r in range(self.world)}
        line = describe_hang(steps, frozen, where, idle=idle, key=self.key, timeout_s=self.timeout_s)
        self.store.set(_REPORT_DONE, "1")
        return line


def main_thread_location() -> str:
    """Where the main thread is, read from another thread: ``in a collective at dir/file.py:line in function`` when
    its innermost Python frame is inside ``torch.distributed`` (waiting for a peer), else ``at ...``."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "at ?"
    code = frame.f_code
    path = Path(code.co_filename)
    short = f"{path.parent.name}/{path.name}:{frame.f_lineno} in {code.co_name}"
    inside = "torch/distributed/" in path.as_posix()
    return f"in a collective at {short}" if inside else f"at {short}"


def _in_collective(location: str | None) -> bool:
    return location is not None and location.startswith("in a collective")


def describe_hang(
    steps: dict[int, int | None],
    frozen: list[int],
    where: dict[int, str | None],
    *,
    idle: float,
    key: str,
    timeout_s: float,
) -> str:
    """The watchdog's line. A rank did not arrive when its process stopped running (``frozen``: its liveness
    counter stood still), when the others wait inside a ``torch.distributed`` call and it does not (``where``: its
    main thread's innermost frame), or when its last finished step is behind the others'."""
    done = [s for s in steps.values() if s is not None]
    front = max(done) if done else None
    waiting = [r for r in steps if r not in frozen and _in_collective(where.get(r))]
    elsewhere = [r for r in steps if r not in frozen and where.get(r) is not None and r not in waiting]
    behind = [r for r, s in steps.items() if r not in frozen and (s is None or (front is not None and s < front))]
    parts = []
    if frozen:
        who = ", ".join(f"rank {r}" for r in frozen)
        parts.append(f"{who} did not arrive (its process stopped running: stopped, frozen or its host gone)")
    if waiting and elsewhere:
        at = ", ".join(f"rank {r} ({where[r]})" for r in elsewhere)
        parts.append(f"{at} did not arrive (the others wait in a collective)")
    elif behind:
        parts.append(", ".join(f"rank {r}" for r in behind) + " did not arrive (behind the others' steps)")
    head = "; ".join(parts) or f"no rank is behind: every rank finished step {front} and runs, none finished the next"
    listing = ", ".join(f"{r}: {s if s is not None else 'none'}" for r, s in steps.items())
    return (
        f"{head}; no step ended for {idle:.1f} s ({key} {timeout_s:g}); last finished step per rank {{{listing}}}; "
        "stopping the job: nothing partial is published, resume: auto continues from the newest complete checkpoint"
    )
