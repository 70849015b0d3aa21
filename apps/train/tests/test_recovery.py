"""What clusters do to long jobs, injected for real: preemption signals, damaged checkpoints, a second job on the
same output directory, a changed model, bad config files (issue 24).

Most run the real entry point in this process as a world of one (a few seconds each); the last one runs
``torchrun`` with 2 gloo ranks: SIGTERM to the launcher a few steps in, a second job refused by the lock meanwhile,
the resume equal to an uninterrupted run, and a checkpoint file that only rank 1 reads, damaged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moeshard.meshes.testing import run_side_by_side
from moeshard.train.__main__ import main

TINY = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.schedule=constant",  # the learning rate does not depend on train.steps: runs of any length compare
    "--logging.progress_bar=false",
    "--logging.tensorboard=false",
    "--logging.expert_load_every=0",
]
ONE = [*TINY, "--parallel.ep_size=1", "--train.global_batch_size=4"]  # a world of one, in this process
# Seconds without a finished step before the watchdog ends the job: above a tiny step and its save on 2 busy cores.
HANG_TIMEOUT = 8


pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def quiet_signals():
    """A stray SIGTERM / SIGUSR1 outside a run does not end pytest (the run installs its own handlers)."""
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, without_launch_env) -> Path:
    """A run of 3 steps with a checkpoint after each (copy it before changing it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with without_launch_env():
        assert main([*ONE, "--train.steps=3", "--checkpoint.every_steps=1", "--checkpoint.keep_last=3"]
                    + [f"--logging.output_dir={out}"]) == 0  # fmt: skip
    return out


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("moeshard-train: error")]


def _fail(capsys, args: list[str], code: int = 2) -> str:
    """Run the entry point, expect ``code`` and exactly one error line, no traceback; return the line."""
    assert main(args) == code
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "Traceback" not in err, err
    return _errors(err)[0]


def _train_records(out: Path) -> list[dict]:
    """The training steps' records of metrics.jsonl (not the evaluations')."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in _train_records(out)]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in _train_records(out)]


# ---- config files, launch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "is empty; give it sections"),
        ("# nothing but a comment\n", "is empty; give it sections"),
        ("- train\n- model\n", "must hold a mapping of sections (model:, train:, ...), got a list"),
        ("train:\n  steps: 5\n lr: [1\n", ".yaml:3:2: YAML syntax error: expected <block end>"),
        ("train:\n\tsteps: 3\n", ".yaml:2:1: YAML syntax error: found character '\\t' that cannot start any token"),
    ],
)
def test_config_file_errors(capsys, tmp_path, text, needle):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    line = _fail(capsys, ["--config", str(path), f"--logging.output_dir={tmp_path / 'out'}"], code=2)
    assert needle in line and str(path) in line
    assert not (tmp_path / "out").exists()


def test_without_torchrun_the_ep_error_says_how_to_launch(capsys, tmp_path):
    line = _fail(capsys, [*TINY, "--parallel.ep_size=2", f"--logging.output_dir={tmp_path / 'out'}"], code=2)
    assert "started without torchrun" in line and "torchrun --nproc-per-node 2 -m moeshard.train" in line
    assert "--parallel.ep_size=1" in line


# ---- preemption --------------------------------------------------------------------------------------------------


def test_signal_saves_the_step_and_the_resume_is_exact(capsys, tmp_path, monkeypatch, quiet_signals):
    import torch.distributed.checkpoint as dcp

    from moeshard import checkpoint as ckpt

    out, ref = tmp_path / "run", tmp_path / "ref"
    base = [*ONE, "--checkpoint.every_steps=2", "--checkpoint.keep_last=10"]
    sent, fired = threading.Event(), []
    real_save = dcp.save

    def save_under_fire(*args, **kwargs):  # a second signal in the middle of the save of the stop
        if sent.is_set():
            fired.append(kwargs["storage_writer"].path)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    def signal_after_step_3():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").is_file() and len(_steps(out)) >= 3:
                sent.set()
                os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's early warning (--signal=USR1@...)
                return
            time.sleep(0.002)

    monkeypatch.setattr(dcp, "save", save_under_fire)
    threading.Thread(target=signal_after_step_3, daemon=True).start()
    assert main([*base, "--train.steps=40", f"--logging.output_dir={out}"]) == 75
    captured = capsys.readouterr()
    assert not _errors(captured.err), captured.err
    stop = json.loads((out / "preempted.json").read_text())
    s = stop["step"]
    assert str(fired[-1]).endswith(f".tmp-step_{s:08d}")  # the second signal came during the stop's save
    assert stop["signal"] == "SIGUSR1" and 3 <= s < 40 and _steps(out) == list(range(1, s + 1))
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("stopped by")]
    assert lines == [
        f"stopped by SIGUSR1 after step {s}: checkpoint {out}/checkpoints/step_{s:08d} is complete; exit status 75, "
        f"the same command resumes at step {s + 1}"
    ]
    done = ckpt.complete_checkpoints(out / "checkpoints")
    assert done[-1].name == f"step_{s:08d}" and len(done) >= 2
    for path in done:  # the stop's checkpoint and the ones before it, all intact
        ckpt.validate_checkpoint(path)
    assert not (out / "job.lock").exists()

    monkeypatch.setattr(dcp, "save", real_save)
    assert main([*base, f"--train.steps={s + 2}", f"--logging.output_dir={out}"]) == 0
    assert f"resumed from {out}/checkpoints/step_{s:08d} at step {s}" in capsys.readouterr().out
    assert _steps(out) == list(range(1, s + 3)) and not (out / "preempted.json").exists()
    assert main([*base, f"--train.steps={s + 2}", f"--logging.output_dir={ref}"]) == 0
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-6)


# ---- damaged checkpoints -----------------------------------------------------------------------------------------


def test_damaged_checkpoints_fall_back_and_are_kept(capsys, tmp_path, trained):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    ckpts = out / "checkpoints"
    shard = ckpts / "step_00000003/__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:1000])  # a truncated shard in the newest
    (ckpts / "step_00000002/.metadata").unlink()  # no metadata in the one before
    assert main([*ONE, "--train.steps=4", "--checkpoint.every_steps=1", f"--logging.output_dir={out}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln for ln in lines if "is damaged" in ln] == [
        f"checkpoint {ckpts}/step_00000003 is damaged: __0_0.distcp has 1000 bytes, COMPLETE recorded {size}; "
        "kept as step_00000003.damaged, resuming from the newest checkpoint that validates instead",
        f"checkpoint {ckpts}/step_00000002 is damaged: .metadata is missing (COMPLETE records it); "
        "kept as step_00000002.damaged, resuming from the newest checkpoint that validates instead",
    ]
    assert f"resumed from {ckpts}/step_00000001 at step 1" in lines
    assert _steps(out) == [1, 2, 3, 4]
    assert (ckpts / "step_00000003.damaged/__0_0.distcp").stat().st_size == 1000  # kept as it was
    # Naming a damaged checkpoint explicitly: one line, nothing written.
    explicit = [f"--checkpoint.resume={ckpts}/step_00000003.damaged", f"--logging.output_dir={tmp_path}/b"]
    line = _fail(capsys, [*ONE, *explicit])
    assert "step_00000003.damaged is damaged: __0_0.distcp has 1000 bytes" in line
    assert not (tmp_path / "b").exists()
    # Every checkpoint damaged: no silent start from scratch.
    for p in ckpts.glob("step_0000000?"):
        (p / ".metadata").unlink()
    line = _fail(capsys, [*ONE, "--train.steps=6", f"--logging.output_dir={out}"])
    assert f"every checkpoint in {ckpts} is damaged" in line


def test_unreadable_shard_is_one_line_and_traceback_on_request(capsys, tmp_path, trained):
    # Same size, other bytes: the files validate, DCP's load fails with CheckpointException (a BaseException).
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shard = out / "checkpoints/step_00000003/__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    args = [*ONE, "--train.steps=4", f"--logging.output_dir={out}"]
    line = _fail(capsys, args)
    assert f"checkpoint {out}/checkpoints/step_00000003 could not be loaded (rank 0: " in line
    os.environ["MOESHARD_TRACEBACK"] = "1"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1
    assert "Traceback (most recent call last)" in err and "CheckpointException" in err and "NoneType: None" not in err


def test_another_model_on_resume_names_each_key(capsys, tmp_path, trained):
    step = trained / "checkpoints/step_00000003"
    args = [*ONE, "--model.overrides.num_experts=16", "--model.overrides.num_hidden_layers=3"]
    line = _fail(capsys, [*args, f"--checkpoint.resume={step}", f"--logging.output_dir={tmp_path / 'o'}"])
    assert f"checkpoint {step} holds another model (" in line
    assert "num_hidden_layers 2 in the checkpoint, 3 now; num_experts 8 in the checkpoint, 16 now" in line
    assert not (tmp_path / "o").exists()


# ---- one job per output directory --------------------------------------------------------------------------------


def test_lock_refuses_a_live_holder_and_takes_over_a_gone_one(capsys, tmp_path, trained):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    lock = out / "job.lock"
    args = [*ONE, "--train.steps=4", f"--logging.output_dir={out}"]
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pid": holder.pid, "pid_start": None, "started": "earlier"}
        lock.write_text(json.dumps(record))
        line = _fail(capsys, args)
        assert (
            f"logging.output_dir {out} is in use by another job (host {socket.gethostname()}, pid {holder.pid}" in line
        )
        assert f"lock file {lock}" in line and json.loads(lock.read_text()) == record
        lock.write_text(json.dumps({**record, "host": "elsewhere", "pid": os.getpid()}))  # alive? unknowable there
        assert "is in use by another job (host elsewhere" in _fail(capsys, args)
    finally:
        holder.kill()
        holder.wait()
    lock.write_text(json.dumps(record))  # its holder is gone now
    assert _steps(out) == [1, 2, 3]
    assert main(args) == 0
    took = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("took over")]
    assert took == [
        f"took over the lock {lock} of a job that is gone (host {socket.gethostname()}, pid {holder.pid}, started "
        f"earlier: pid {holder.pid} is gone)"
    ]
    assert _steps(out) == [1, 2, 3, 4] and not lock.exists()


# ---- under torchrun ----------------------------------------------------------------------------------------------


def _torchrun_command(args: list[str]) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    return [*command, "moeshard.train", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(_torchrun_command(args), env=_env(), text=True, **kwargs)


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return _run_both(args, timeout=timeout)[0]


def _run_both(*jobs: list[str], timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Each of ``jobs`` under its own ``torchrun``, all at once; their outputs (stderr in stdout) once all have ended."""
    return run_side_by_side(*map(_torchrun_command, jobs), timeout=timeout, env=_env(), merge_stderr=True)


@pytest.mark.slow
def test_sigterm_to_torchrun_second_job_resume_and_a_rank_local_error(tmp_path):
    out, ref, damaged = tmp_path / "run", tmp_path / "ref", tmp_path / "damaged"
    # timeout_s: above the time the first job's workers spend stopped below, on a slow machine too
    job = [*TINY, "--checkpoint.every_steps=3", "--checkpoint.keep_last=10", "--train.timeout_s=600"]
    log_a = tmp_path / "a.log"
    with log_a.open("w") as f:
        a = _torchrun([*job, "--train.steps=200", f"--logging.output_dir={out}"], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").is_file() and len(_steps(out)) >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        # A second job on the same output directory stops in one line; the first one runs on. The first one's
        # workers are stopped (alive, holding the lock) while the second one starts: running, they would take
        # dozens of steps in its start-up, each of which the uninterrupted reference below would train again.
        workers = [pid for rank in (0, 1) for pid in _process_tree(_worker_pid(a.pid, rank))]
        assert len(workers) >= 2, log_a.read_text()[-3000:]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            taken = len(_steps(out))
            b = _run([*job, "--train.steps=200", f"--logging.output_dir={out}"])
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        assert b.returncode == 1 and a.poll() is None, b.stdout[-3000:]
        assert len(_errors(b.stdout)) == 1, b.stdout[-3000:]
        holder = json.loads((out / "job.lock").read_text())
        assert f"is in use by another job (host {holder['host']}, pid {holder['pid']}" in _errors(b.stdout)[0]
        while len(_steps(out)) <= taken and a.poll() is None and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        a.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to every worker
        a.wait(timeout=120)
    finally:
        if a.poll() is None:
            a.kill()
    log = log_a.read_text()
    # torchrun exits 1 after a signal (its own SignalException) whatever its workers return.
    assert a.returncode == 1 and not _errors(log), log[-4000:]
    s = json.loads((out / "preempted.json").read_text())["step"]
    assert len(re.findall(rf"^stopped by SIGTERM after step {s}: ", log, re.M)) == 1, log[-4000:]
    assert _steps(out) == list(range(1, s + 1)) and taken < s < 200  # it ran on after the second job
    assert (out / f"checkpoints/step_{s:08d}/COMPLETE").is_file() and not (out / "job.lock").exists()

    # A file only rank 1 reads, damaged (same size), in a copy of the run: its resume runs beside the resume and
    # the uninterrupted reference (three independent jobs: their start-ups overlap).
    shutil.copytree(out, damaged)
    rank_file = damaged / f"checkpoints/step_{s:08d}/rank_00001.pt"
    rank_file.write_bytes(b"x" * rank_file.stat().st_size)
    res, uninterrupted, broken = _run_both(
        [*job, f"--train.steps={s + 2}", f"--logging.output_dir={out}"],
        [*job, f"--train.steps={s + 2}", f"--logging.output_dir={ref}"],
        [*job, f"--train.steps={s + 1}", f"--logging.output_dir={damaged}"],
    )
    assert res.returncode == 0 and f"resumed from {out}/checkpoints/step_{s:08d} at step {s}" in res.stdout
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-3000:]
    assert _steps(out) == list(range(1, s + 3))
    assert _losses(out) == pytest.approx(_losses(ref), rel=1e-6)

    # The damaged rank file: rank 1 says so in one line, rank 0 (lost its peer) is silent.
    assert broken.returncode == 1
    assert _errors(broken.stdout) == [
        f"moeshard-train: error (rank 1): checkpoint {damaged}/checkpoints/step_{s:08d}: rank_00001.pt is unreadable "
        "(UnpicklingError: weights_only refused it: Unsupported operand 120); its files may be damaged: resume an older checkpoint with "
        "checkpoint.resume=<folder>"
    ], broken.stdout[-4000:]


def _process_tree(pid: int | None) -> list[int]:
    """``pid`` and every process below it, parents first (Linux ``/proc``); [] for None."""
    if pid is None:
        return []
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo += parents.get(tree[-1], [])
    return tree


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker of ``rank`` (a child of the launcher with RANK=rank), Linux ``/proc``."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    return None


@pytest.mark.slow
def test_a_stopped_worker_ends_the_job_within_its_timeout_and_the_resume_is_intact(capsys, tmp_path):
    # SIGSTOP one worker: its peer blocks in a collective; within train.timeout_s the job ends with one line naming
    # the stopped rank and each rank's last step, nothing partial published; a resume (here in this process, a world
    # of one: checkpoints are layout independent) continues from the newest complete checkpoint, as the same
    # command or a torchrun --max-restarts restart does.
    out = tmp_path / "run"
    job = [*TINY, "--checkpoint.every_steps=2", "--checkpoint.keep_last=3", f"--train.timeout_s={HANG_TIMEOUT}"]
    log = tmp_path / "a.log"
    with log.open("w") as f:
        a = _torchrun([*job, "--train.steps=400", f"--logging.output_dir={out}"], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").is_file() and len(_steps(out)) >= 3) and time.monotonic() < deadline:
            assert a.poll() is None, log.read_text()[-3000:]  # the job ended before its third step
            time.sleep(0.1)
        stopped = _worker_pid(a.pid, rank=1)
        assert stopped is not None, log.read_text()[-3000:]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        while "did not arrive" not in log.read_text() and time.monotonic() < t0 + 90:
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        os.kill(stopped, signal.SIGKILL)  # what the agent does 30 s after its SIGTERM to a worker that does not end
        a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
    text = log.read_text()
    lines = [ln for ln in text.splitlines() if "did not arrive" in ln]
    in_time = HANG_TIMEOUT <= elapsed < HANG_TIMEOUT + 20
    assert len(lines) == 1 and in_time and a.returncode != 0, (elapsed, text[-4000:])
    m = re.search(r"last finished step per rank \{0: (\d+), 1: (\d+)\}", lines[0])
    assert lines[0].startswith("rank 1 did not arrive (its process stopped running") and m, lines[0]
    assert f"(train.timeout_s {HANG_TIMEOUT:g})" in lines[0]
    last = int(m.group(1))
    ckpts = out / "checkpoints"
    published = sorted(int(p.name[5:]) for p in ckpts.glob("step_????????"))
    assert published and all((ckpts / f"step_{s:08d}/COMPLETE").is_file() for s in published)  # nothing partial
    assert max(published) <= last

    capsys.readouterr()
    assert main([*job, "--parallel.ep_size=1", f"--train.steps={last + 1}", f"--logging.output_dir={out}"]) == 0
    resumed = f"resumed from {ckpts}/step_{max(published):08d} at step {max(published)}"
    assert resumed in capsys.readouterr().out
