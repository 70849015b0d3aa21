"""Run one device-agnostic test body on N CPU processes with the gloo backend.

    from moeshard.meshes.testing import run_distributed

    def _body(scale):                      # module level: each rank re-loads it from its file
        import torch.distributed as dist
        return dist.get_rank() * scale

    def test_ranks():
        assert run_distributed(_body, 4, 10) == [0, 10, 20, 30]

Each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (from ``ranks_per_node``) set, a
default gloo process group already initialised through a TCPStore on a free port (no port races), and one
thread. On success the harness runs ``barrier`` then ``destroy_process_group`` (gloo aborts at exit
otherwise). A failure on any rank fails the call with that rank's traceback; a hang fails after ``timeout``
seconds with every live rank's Python stack. Each rank's stdout and stderr go to a file of its own, whose last lines
the failure's message carries for every rank that failed or hung (what native code printed too: a crash's message and
the Python stack where it happened). A rank ended by a signal without a Python error (a crash in native code) runs
the whole call again once (``reruns_after_crash``), with a :class:`DistributedRerunWarning` carrying the crash's
report. The ranks are forked from a fork server that
imported torch's distributed modules once (:data:`PRELOAD`), each with the caller's environment, working
directory and ``sys.path``, as a spawned process would have them (spawned where forking is not available).

``run_side_by_side(*cmds, timeout=...)`` runs independent commands (``torchrun`` jobs, scripts) as subprocesses
all at once and returns each one's :class:`subprocess.CompletedProcess`; a job that outlives the deadline is
killed and fails the call.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRerunWarning", "DistributedTestError", "run_distributed", "run_side_by_side"]

_LOADED: dict[str, Any] = {}
PRELOAD = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "moeshard.meshes.testing",
)
"""What the ranks' fork server imports once for all the ranks it starts (those that are installed): ~9 s of imports
per rank on a small CPU that a spawned rank would pay each time."""


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung; the message holds their tracebacks."""


class DistributedRerunWarning(UserWarning):
    """A rank of :func:`run_distributed` crashed in native code and the call ran again; the message holds the
    crash's report."""


def _resolve(path: str, module_name: str, qualname: str) -> Callable[..., Any]:
    mod = sys.modules.get(module_name)
    if mod is None or getattr(mod, "__file__", None) != path:
        mod = _LOADED.get(path)
        if mod is None:
            spec = importlib.util.spec_from_file_location(f"_moeshard_dist_{abs(hash(path))}", path)
            assert spec is not None and spec.loader is not None, path
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            _LOADED[path] = mod
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank, world_size, ranks_per_node, port, backend, fn_ref, args, kwargs, results, timeout, caller, log):
    # This rank's stdout and stderr go to its own file (what native code prints too: an abort's message, a hang's
    # stacks), which the caller reads back where the rank fails; a forked child would otherwise write to the fds
    # the fork server was started with (a test's capture that may be gone).
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A forked child has the fork server's environment, directory and path: this rank takes the caller's (its
    # environment with the call's extra variables), as a spawned one would have them.
    environ, cwd, path = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        GROUP_RANK=str(rank // ranks_per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash in native code prints the Python stack where it happened
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)  # a hang shows where it hangs
    try:
        fn = _resolve(*fn_ref)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=_td(timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_td(timeout))
        out = fn(*args, **kwargs)
        dist.barrier()
        dist.destroy_process_group()
        # By value: the queue's own pickler would share tensor storage with a process that is about to exit.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _context():
    """Ranks forked from a fork server that has imported :data:`PRELOAD` (started once per process, at the first
    call); where forking is not available, spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class _Attempt:
    """What one launch of the ranks gave: results by rank, failures by rank, ranks that did not finish, and the
    ranks that a signal ended without a report (a crash in native code)."""

    def __init__(self) -> None:
        self.outputs: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.missing: list[int] = []
        self.crashed: list[int] = []
        self.logs: dict[int, str] = {}

    def report(self, name: str, world_size: int, timeout: float) -> str:
        parts = [f"--- rank {r} failed ---\n{self.errors[r]}" for r in sorted(self.errors)]
        if self.missing:
            parts.append(
                f"--- ranks {self.missing} did not finish within {timeout:.0f}s "
                "(hung or blocked on a failed rank; their stacks are in their output below) ---"
            )
        for r in sorted({*self.errors, *self.missing}):
            if self.logs.get(r, "").strip():
                parts.append(f"--- rank {r}'s output (last {_LOG_LINES} lines) ---\n{self.logs[r]}")
        return f"{name} on {world_size} processes:\n" + "\n".join(parts)


_LOG_LINES = 60


def _tail(path: str, lines: int = _LOG_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _dead(procs: list[Any], attempt: _Attempt) -> None:
    """Record the ranks that exited with an error and no report; those a signal ended (a crash) as crashed."""
    for r, p in enumerate(procs):
        code = p.exitcode
        if code in (None, 0) or r in attempt.outputs or r in attempt.errors:
            continue
        attempt.errors[r] = f"process exited with code {code} without reporting"
        if code < 0:
            attempt.crashed.append(r)


def _attempt(fn_ref, world_size, ranks_per_node, timeout, backend, env, args, kwargs) -> _Attempt:
    attempt = _Attempt()
    # The parent owns the store on port 0 (the OS picks a free port), so concurrent tests never collide.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=_td(timeout))
    ctx = _context()
    results = ctx.Queue()
    logdir = tempfile.mkdtemp(prefix="moeshard-ranks-")
    logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
    caller = ({**os.environ, **(env or {})}, os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                ranks_per_node,
                store.port,
                backend,
                fn_ref,
                args,
                kwargs,
                results,
                timeout,
                caller,
                logs[r],
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    outputs, errors = attempt.outputs, attempt.errors
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if errors:  # the other ranks are probably blocked on the failed one: give them a moment, then stop
                remaining = min(remaining, 5.0)
            if remaining <= 0:
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                _dead(procs, attempt)
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        _dead(procs, attempt)  # before the live ones are terminated
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
        attempt.missing = [r for r in range(world_size) if r not in outputs and r not in errors]
        attempt.logs = {r: _tail(logs[r]) for r in range(world_size) if r not in outputs}
        with contextlib.suppress(OSError):
            for log in logs:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(log)
            os.rmdir(logdir)
    return attempt


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    ranks_per_node: int | None = None,
    timeout: float = 240.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    reruns_after_crash: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` new processes and return each rank's result.

    Args:
        fn: a module-level function (each rank loads it from its source file); it runs with the default
            process group initialised.
        world_size: number of processes.
        ranks_per_node: ``LOCAL_WORLD_SIZE`` given to each rank (stands in for GPUs per node);
            defaults to ``world_size`` (one node).
        timeout: seconds before a hang fails the call.
        backend: process-group backend (``gloo`` on CPU).
        env: extra environment variables for every rank.
        reruns_after_crash: how many times the whole call is run again where a rank was ended by a signal
            without a Python error (a crash in native code: a rank of a gloo test was once ended by SIGABRT, cause
            unknown, on a 2-core machine where the same test passes run after run), each time with a
            :class:`DistributedRerunWarning` that carries the crash's report (the ranks' last output, with the
            Python stack where it happened). A Python error or a hang alone never reruns (ranks blocked on a crashed
            one do). ``0``: a crash fails the call.

    Returns:
        The picklable return values, indexed by rank.

    Raises:
        DistributedTestError: a rank raised or crashed (its traceback or its last output is in the message) or
            the run timed out.
    """
    if reruns_after_crash < 0:
        raise ValueError(f"reruns_after_crash={reruns_after_crash} must be >= 0")
    ranks_per_node = ranks_per_node or world_size
    path = os.path.abspath(fn.__code__.co_filename)
    fn_ref = (path, fn.__module__, fn.__qualname__)
    for left in range(reruns_after_crash, -1, -1):
        attempt = _attempt(fn_ref, world_size, ranks_per_node, timeout, backend, env, args, kwargs)
        if not attempt.errors and not attempt.missing:
            return [attempt.outputs[r] for r in range(world_size)]
        report = attempt.report(fn.__qualname__, world_size, timeout)
        if not attempt.crashed or left == 0:
            raise DistributedTestError(report)
        warnings.warn(
            f"rank(s) {attempt.crashed} crashed; running the call again ({left} rerun(s) left):\n{report}",
            DistributedRerunWarning,
            stacklevel=2,
        )
    raise AssertionError("unreachable")  # pragma: no cover


def run_side_by_side(
    *cmds: Sequence[str],
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | Sequence[Mapping[str, str] | None] | None = None,
    merge_stderr: bool = False,
) -> list[subprocess.CompletedProcess[str]]:
    """Run independent commands as subprocesses, all at once, and return each one's result once all have ended.

    Every command is started before any is waited on, so their start-ups overlap. Each one's stdout and stderr go
    to temporary files (a large output never blocks on a full pipe), read back as text (UTF-8, undecodable bytes
    replaced) once every command has ended. On a timeout, or any exception (a command that cannot be started, an
    interrupt), every command still running is killed (SIGKILL to the process itself: processes it started, such
    as torchrun's workers, are not signalled) and reaped before the call returns or raises.

    Args:
        cmds: the commands, as argument lists (no shell).
        timeout: seconds for the whole set, counted from before the first start: one deadline, not one per command.
        cwd: working directory of every command (``None``: this process's).
        env: the environment of every command, as ``subprocess.Popen``'s ``env`` (it replaces this process's;
            ``None`` inherits it), or a sequence of such, one per command.
        merge_stderr: send stderr into stdout (one interleaved log); each result's ``stderr`` is then ``None``.

    Returns:
        One :class:`subprocess.CompletedProcess` per command, in order of ``cmds``: ``args``, ``returncode``
        (negative: ended by that signal) and the captured output. A non-zero return code is not an error here.

    Raises:
        subprocess.TimeoutExpired: a command was still running at the deadline (the first such one in order is
            named, with what it wrote so far as ``output`` and ``stderr``); raised after all were killed and reaped.
        ValueError: ``env`` is a sequence whose length is not the number of commands.
    """
    envs = [env] * len(cmds) if env is None or isinstance(env, Mapping) else list(env)
    if len(envs) != len(cmds):
        raise ValueError(f"env: {len(envs)} environments for {len(cmds)} commands")
    with contextlib.ExitStack() as files:

        def log() -> IO[str]:
            return files.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))

        logs = [(log(), None if merge_stderr else log()) for _ in cmds]
        procs: list[subprocess.Popen[str]] = []
        late: int | None = None
        deadline = time.monotonic() + timeout
        try:
            for cmd, cmd_env, (out, err) in zip(cmds, envs, logs):
                stderr = subprocess.STDOUT if err is None else err
                procs.append(subprocess.Popen(list(cmd), cwd=cwd, env=cmd_env, stdout=out, stderr=stderr))
            for i, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    late = i
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
        results = [
            subprocess.CompletedProcess(proc.args, proc.returncode, _read(out), None if err is None else _read(err))
            for proc, (out, err) in zip(procs, logs)
        ]
    if late is not None:
        raise subprocess.TimeoutExpired(procs[late].args, timeout, results[late].stdout, results[late].stderr)
    return results


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()
