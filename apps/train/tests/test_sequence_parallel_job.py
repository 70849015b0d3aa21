"""The job at sequence parallelism: ``launch-local --nnodes 2 --nproc-per-node 2`` with ``--parallel.sp_size=2`` (a
sequence group of 2 inside each node, EP 2: two data-parallel groups of the same 8 rows a step) trains, and its
step-2 checkpoint resumes at sp 1 (here in this process, a world of one: checkpoints are layout independent) with the
same losses as the uninterrupted run: sp changes no parameter's sharding, and the loss is the mean over every target
of the global batch at either sp."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a 4-rank launch

JOB = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.steps=3",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=1",  # the micro-batch aux loss is then each row's, at any data-parallel degree
    "--checkpoint.every_steps=2",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


def _launch(out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "2", "--nproc-per-node", "2", "--"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return subprocess.run(
        [*cmd, *JOB, f"--logging.output_dir={out}", *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def _losses(out) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_sp2_trains_and_resumes_at_sp1_with_the_same_losses(tmp_path, capsys):
    from moeshard.train.__main__ import main

    a = _launch(tmp_path / "a", "--parallel.sp_size=2")
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-5000:]
    assert "sp 2 x dp 2" in a.stdout and "[0,1], [2,3]" in a.stdout  # the sequence groups, inside each node
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    resume = ["--parallel.sp_size=1", "--parallel.ep_size=1", f"--checkpoint.resume={step2}"]
    assert main([*JOB, f"--logging.output_dir={tmp_path / 'b'}", *resume]) == 0, capsys.readouterr()
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(la) == [1, 2, 3] and sorted(lb) == [3]
    assert lb[3] == pytest.approx(la[3], rel=1e-4, abs=1e-5), (la, lb)
