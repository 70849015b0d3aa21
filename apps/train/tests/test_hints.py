"""Each fix an error message suggests, followed literally, gets past that error.

The checks before a job starts (``moeshard.train.run.prepare``) need no process group: a world of several ranks is
checked here from torchrun's variables alone, in this process.
"""

from __future__ import annotations

import os
import re

import pytest

from moeshard.train.config import ConfigError, load_config
from moeshard.train.errors import JobError
from moeshard.train.run.prepare import prepare

TINY = ["--model.overrides.num_hidden_layers=2", "--data.seq_len=32", "--logging.progress_bar=false"]


@pytest.fixture(autouse=True)
def _env(clean_env):
    yield


def _refused(overrides: list[str]) -> str:
    with pytest.raises((JobError, ConfigError)) as e:
        prepare(load_config(None, overrides))
    return str(e.value)


def _world(n: int, per_node: int | None = None) -> None:
    os.environ.update({"RANK": "0", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(per_node or n)})


@pytest.mark.parametrize(("gbs", "suggested"), [(6, 8), (16, None)])
def test_the_single_process_hint_runs_under_the_torchrun_it_suggests(tmp_path, gbs, suggested):
    job = [*TINY, "--parallel.ep_size=2", f"--train.global_batch_size={gbs}", f"--logging.output_dir={tmp_path}/o"]
    message = _refused(job)
    command = re.search(r"run `torchrun --nproc-per-node (\d+) -m moeshard.train \.\.\.([^`]*)`", message)
    assert command, message
    extra = command[2].split()
    assert extra == ([f"--train.global_batch_size={suggested}"] if suggested else [])
    assert f"launch-local --nnodes 1 --nproc-per-node 2 -- ...{command[2]}`" in message
    _world(int(command[1]))  # what torchrun --nproc-per-node N gives each worker
    prepare(load_config(None, [*job, *extra]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        del os.environ[k]
    assert message.endswith("or set --parallel.ep_size=1")
    prepare(load_config(None, [*job, "--parallel.ep_size=1"]))


def test_the_default_batch_with_ep_3_gets_a_batch_that_3_processes_take():
    message = _refused(["--parallel.ep_size=3"])
    assert "-m moeshard.train ... --train.global_batch_size=18`" in message  # 16 rows over 3 x micro-batch 2: 18


def test_cross_node_ep_hint(tmp_path):
    job = [*TINY, "--parallel.ep_size=4", "--model.overrides.num_experts=8", f"--logging.output_dir={tmp_path}/o"]
    _world(4, 2)
    message = _refused(job)
    assert "set parallel.allow_cross_node_ep=true" in message, message
    prepare(load_config(None, [*job, "--parallel.allow_cross_node_ep=true"]))


def test_resume_hints(capsys, tmp_path):
    from moeshard.train.__main__ import main

    out = tmp_path / "run"
    base = [*TINY, "--parallel.ep_size=1", "--train.steps=1", "--train.global_batch_size=2"]
    assert main([*base, "--logging.tensorboard=false", f"--logging.output_dir={out}"]) == 0
    ckpt = next((out / "checkpoints").glob("step_*"))
    # The same run with resume 'none': "Use checkpoint.resume=auto to continue it".
    message = _refused([*base, f"--logging.output_dir={out}", "--checkpoint.resume=none"])
    assert "Use checkpoint.resume=auto to continue it" in message
    assert prepare(load_config(None, [*base, f"--logging.output_dir={out}", "--checkpoint.resume=auto"])).resume_path
    # Another model, from the run's folder (auto) or from the checkpoint by name: the hint's new folder with
    # resume 'none' starts it.
    other = [*base, "--model.overrides.num_hidden_layers=3"]
    for resume in ("auto", str(ckpt)):
        message = _refused([*other, f"--logging.output_dir={out}", f"--checkpoint.resume={resume}"])
        assert "holds another model" in message
        assert message.endswith("start this model in a new logging.output_dir with checkpoint.resume=none")
        new = f"--logging.output_dir={tmp_path}/new-{len(resume)}"
        assert prepare(load_config(None, [*other, new, "--checkpoint.resume=none"])).resume_path is None
