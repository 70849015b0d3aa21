"""``run_side_by_side``: captured outputs and return codes, overlapping starts, one deadline, no process left."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moeshard.meshes.testing import run_side_by_side


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int) -> bool:
    """``pid`` has ended and was reaped (a zombie still answers signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_outputs_return_codes_cwd_and_env(tmp_path):
    ok = _py("import os, sys; print('out', os.getcwd()); print('err', os.environ['X'], file=sys.stderr)")
    failed = _py("import sys; print('bye', file=sys.stderr); sys.exit(3)")
    a, b = run_side_by_side(ok, failed, timeout=30, cwd=tmp_path, env=[{**os.environ, "X": "1"}, None])
    assert (a.args, a.returncode, a.stdout, a.stderr) == (ok, 0, f"out {tmp_path}\n", "err 1\n")
    assert (b.returncode, b.stdout, b.stderr) == (3, "", "bye\n")
    (merged,) = run_side_by_side(
        _py("import sys; print('a', flush=True); print('b', file=sys.stderr)"), timeout=30, merge_stderr=True
    )
    assert (merged.stdout, merged.stderr) == ("a\nb\n", None)
    with pytest.raises(ValueError, match="env: 1 environments for 2 commands"):
        run_side_by_side(ok, ok, timeout=30, env=[None])


def test_commands_run_at_once():
    t0 = time.monotonic()
    results = run_side_by_side(*[_py("import time; time.sleep(2)")] * 2, timeout=30)
    assert [r.returncode for r in results] == [0, 0]
    assert time.monotonic() - t0 < 3.5  # one after the other would take over 4 s (1.5 s for two starts when loaded)


def test_a_timeout_kills_and_reaps_every_running_command_then_raises():
    sleeper = _py("import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_side_by_side(_py("pass"), sleeper, sleeper, timeout=1.0)
    assert time.monotonic() - t0 < 10
    assert err.value.cmd == sleeper and err.value.timeout == 1.0 and err.value.stderr == ""
    assert _gone(int(err.value.output))


def test_a_command_that_cannot_start_stops_the_ones_started(monkeypatch, tmp_path):
    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    with pytest.raises(FileNotFoundError):
        run_side_by_side(_py("import time; time.sleep(60)"), [str(tmp_path / "missing")], timeout=30)
    assert len(started) == 1 and started[0].returncode is not None and _gone(started[0].pid)
