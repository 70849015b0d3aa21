"""Every command of ``moeshard-train`` with a bad input: one line, ``moeshard-train: error: ...``, and the exit status
of its kind (2 a user's error, 1 an unexpected one); rank 0 alone reports an error every rank raises, also under a
real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

import moeshard.train.__main__ as entry
from moeshard.data import ExitStatus
from moeshard.train.__main__ import main

PREFIX = "moeshard-train: error: "


def _one_line(capsys, argv: list[str], status: int) -> str:
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--train.stepz=3"], "config: unknown config key train.stepz; did you mean train.steps?"),
        (["trian"], "unknown command 'trian'; did you mean train?"),
        (["--config"], "argument --config: expected one argument (`moeshard-train --help` lists the options)"),
        (["config", "--train.steps=many"], "config: train.steps must be an integer, got 'many'"),
        (["plan", "--nnodes", "x", "--nproc-per-node", "2"], "plan: argument --nnodes: invalid int value: 'x'"),
        (["plan", "--nproc-per-node", "2"], "plan: the following arguments are required: --nnodes"),
        (["plan", "--nnodes", "2", "--nproc-per-node", "2", "--parallel.ep_size=4"], "would cross a node boundary"),
        (["export-hf", "--checkpoint", "{tmp}/none", "--out", "{tmp}/o"], "checkpoint {tmp}/none does not exist"),
        (["export-hf", "--out", "{tmp}/o"], "export-hf: the following arguments are required: --checkpoint"),
        (["prepare-data", "--input", "{tmp}/none.jsonl", "--output", "{tmp}/p"], "{tmp}/none.jsonl does not exist"),
        (["prepare-data", "--output", "{tmp}/p"], "the following arguments are required: --input"),
        (["bench", "--trace-steps", "0"], "bench: --trace-steps must be at least 1, got 0"),
        (["bench", "--layers", "4"], "bench: --layers is a key of the job now: write --model.overrides."),
        pytest.param(
            ["launch-local", "--nnodes", "x"],
            "launch-local: argument --nnodes: invalid int value: 'x'",
        ),
    ],
)
def test_each_command_says_a_bad_input_in_one_line_with_status_2(capsys, clean_env, tmp_path, argv, needle):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert needle.format(tmp=tmp_path) in _one_line(capsys, argv, ExitStatus.USER_ERROR)
    assert not (tmp_path / "o").exists()


def test_an_unexpected_error_is_one_line_with_status_1_and_its_traceback_on_request(capsys, clean_env, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(entry, "plan", broken)
    argv = ["plan", "--nnodes", "1", "--nproc-per-node", "1"]
    line = _one_line(capsys, argv, ExitStatus.FAILED)
    assert line == f"{PREFIX}KeyError: 'a bug' (unexpected; MOESHARD_TRACEBACK=1 shows the traceback)"
    monkeypatch.setenv("MOESHARD_TRACEBACK", "1")
    assert main(argv) == ExitStatus.FAILED
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.fixture
def agent_store(clean_env, monkeypatch):
    """A store standing for torchrun's agent store, and the environment torchrun gives a worker of a world of 2."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    env |= {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return store


def test_other_ranks_wait_silently_until_rank_0_said_it(capsys, agent_store, monkeypatch):
    # Rank 1 gets there first: it waits until rank 0 has printed (exited at once, torchrun could stop rank 0 before
    # its line), then returns without a word.
    monkeypatch.setenv("RANK", "1")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (entry._report("config: bad", alike=True), done.set()))
    worker.start()
    time.sleep(0.5)
    assert not done.is_set()
    agent_store.add("moeshard/t/0/errors/said", 1)  # what rank 0 adds after its line
    worker.join(timeout=20)
    assert done.is_set() and capsys.readouterr().err == ""
    # Rank 0 prints and tells the others.
    monkeypatch.setenv("RANK", "0")
    entry._report("config: bad", alike=True)
    assert capsys.readouterr().err == f"{PREFIX}config: bad\n"
    assert agent_store.add("moeshard/t/0/errors/said", 0) == 2


def test_a_rank_that_waited_in_vain_says_it_itself(capsys, agent_store, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(entry, "ALIKE_WAIT_S", 0.3)
    entry._report("config: bad", alike=True)
    assert capsys.readouterr().err == "moeshard-train: error (rank 1; rank 0 did not report it): config: bad\n"


def test_under_torchrun_rank_0_says_it_once(tmp_path):
    # A real torchrun of 2 workers; the two variables keep torchrun's own lines few (its banner; its copy of the
    # root cause, written to the file instead of an error line). Its summary (a ChildFailedError) stays.
    agent_file = tmp_path / "agent_error.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": str(agent_file)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
    run = subprocess.run(
        [*command, "-m", "moeshard.train", "--train.stepz=5"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    out = run.stdout + run.stderr
    ours = [ln for ln in out.splitlines() if ln.startswith("moeshard-train: error")]
    assert ours == [f"{PREFIX}config: unknown config key train.stepz; did you mean train.steps?"], out
    assert out.count("Traceback") == 1 and "ChildFailedError" in out  # torchrun's own, none of our workers
    assert "exitcode  : 2" in out and "OMP_NUM_THREADS" not in out and "no error file defined" not in out
    assert run.returncode == 1  # torchrun's status when a worker fails, whatever the worker's
    copied = json.loads(agent_file.read_text())["message"]
    # torchrun copies the earliest error file: rank 0's (status 2), or a waiting rank's, which wrote the same line
    # and was then stopped by torchrun's SIGTERM (-15), whichever file is older
    assert copied["message"] == ours[0].removeprefix(PREFIX) and copied["errorCode"] in (2, -15)


def test_the_usage_text_documents_the_statuses():
    text = entry._help()
    assert "Exit status: 0 done; 2 a user's error" in text and "moeshard-train: error: ..." in text
