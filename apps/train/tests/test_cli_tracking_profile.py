"""A command line that explains itself, experiment tracking and profiling (issue 22).

``--help`` lists the commands; ``config --show`` gives every key a value, default and meaning; ``plan --summary``;
rough edges (the cross-node EP key, ``train.min_lr`` relative to ``lr``, a Hub id as tokenizer). W&B and MLflow are
tested through fake modules (CI installs neither) and, where installed, for real in their offline modes; the
profiler's Chrome trace appears on CPU. The runs are the real entry point in this process, as a world of one.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from moeshard.train.__main__ import COMMANDS, main
from moeshard.train.config import JobConfig, describe_keys, load_config

ONE = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--parallel.ep_size=1",
    "--train.global_batch_size=4",
    "--train.steps=3",
    "--logging.tensorboard=false",
    "--logging.expert_load_every=0",
]


pytestmark = pytest.mark.usefixtures("clean_env")


def _error(capsys, args: list[str], code: int = 1) -> str:
    assert main(args) == code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("moeshard-train: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _scalars(record: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}/"))
        elif prefix + k != "step" and isinstance(v, (int, float)):
            out[prefix + k] = v
    return out


# ---- the command line --------------------------------------------------------------------------------------------


def test_help_lists_every_command_and_an_unknown_one_is_named(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for name, line in COMMANDS.items():
        assert f"  {name:14s}{line}" in text
    assert set(COMMANDS) == {"train", "config", "plan", "export-hf", "launch-local", "bench", "prepare-data"}
    assert "did you mean plan?" in _error(capsys, ["plna"], code=2)


def test_bench_profiles_steps_back_to_back_and_refuses_none():
    from moeshard.train.commands.bench import _parse_args
    from moeshard.train.errors import UsageError

    assert _parse_args([])[0].trace_steps == 1
    assert _parse_args(["--trace-steps", "3"])[0].trace_steps == 3
    with pytest.raises(UsageError, match="--trace-steps must be at least 1, got 0"):
        _parse_args(["--trace-steps", "0"])
    # one step from the empty launch queue that follows the timed loop runs first, recorded by nothing
    assert _parse_args([])[0].trace_warmup == 1
    assert _parse_args(["--trace-warmup", "0"])[0].trace_warmup == 0
    with pytest.raises(UsageError, match="--trace-warmup must be at least 0, got -1"):
        _parse_args(["--trace-warmup", "-1"])


def test_bench_trace_leaves_out_the_warm_up_steps(tmp_path, monkeypatch):
    # The steps run under the profiler's warm-up phase are in no trace: only the --trace-steps after them are.
    import torch
    from torch.profiler import record_function

    import moeshard.train.commands.bench_steps
    from moeshard.train.commands.bench import _parse_args
    from moeshard.train.commands.bench_steps import profile_step

    ran: list[int] = []

    def train_step(job, micro):
        with record_function(f"bench_step_{micro}"):
            torch.ones(8) @ torch.ones(8)
        ran.append(micro)

    monkeypatch.setattr(moeshard.train.commands.bench_steps, "train_step", train_step)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    for warmup, traced in ((1, 2), (2, 1), (0, 2)):
        ran.clear()
        counter = iter(range(10))
        path = tmp_path / f"w{warmup}.json"
        args = _parse_args(["--trace", str(path), "--trace-steps", str(traced), "--trace-warmup", str(warmup)])[0]
        profile_step(args, None, counter.__next__)
        names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]}
        steps = sorted(int(n.rsplit("_", 1)[1]) for n in names if n.startswith("bench_step_"))
        assert ran == list(range(warmup + traced))
        assert steps == list(range(warmup, warmup + traced)), (warmup, traced, steps)


def test_config_show_explains_every_key(capsys, tmp_path):
    rows = describe_keys(JobConfig())
    assert [key for key, _, _, meaning in rows if not meaning] == []  # every key has its one line
    keys = [key for key, *_ in rows]
    assert len(keys) == len(set(keys)) and {"checkpoint.async", "logging.wandb.project", "data.seq_len"} <= set(keys)
    assert main(["config", "--show", "--train.lr=1e-4"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["key", "value", "default", "meaning"]
    assert len(table) == len(rows) + 1
    min_lr = next(line for line in table if line.startswith("train.min_lr "))
    assert min_lr.split()[1:3] == ["*1e-05", "0.0003"] and "a tenth of train.lr" in min_lr  # changed: marked
    wandb = next(line for line in table if line.startswith("logging.wandb.project "))
    assert wandb.split()[1:3] == ["(off)", "moeshard"]
    # Without --show: the resolved YAML, which loads back to the same job.
    assert main(["config", "--train.lr=1e-4", "--checkpoint.async=true", "--logging.wandb.project=x"]) == 0
    (tmp_path / "job.yaml").write_text(capsys.readouterr().out)
    expected = load_config(None, ["--train.lr=1e-4", "--checkpoint.async=true", "--logging.wandb.project=x"])
    assert load_config(tmp_path / "job.yaml") == expected


def test_config_show_lists_every_parallel_key_with_its_fields_help(capsys):
    """``parallel:`` is ``ParallelOptions`` (``parallel.ep``: ``EPOptions``) plus the job's mesh keys: ``config --show``
    lists each field as a key, with the help its definition carries, and a nested override reaches its field."""
    import dataclasses

    from moeshard.ep import EPOptions
    from moeshard.models.common import ParallelOptions
    from moeshard.train.config import ParallelConfig

    assert issubclass(ParallelConfig, ParallelOptions)
    fields = {f"parallel.{f.name}": f for f in dataclasses.fields(ParallelConfig)}
    fields |= {f"parallel.ep.{f.name}": f for f in dataclasses.fields(EPOptions)}
    assert {"parallel.ep_size", "parallel.allow_cross_node_ep", "parallel.ep.dispatch"} <= set(fields)
    assert main(["config", "--show", "--parallel.ep.dispatch=all_to_all", "--parallel.ep.sm_carveout=0"]) == 0
    shown = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert sorted(k for k in shown if k.startswith("parallel.")) == sorted(fields)
    for key, f in fields.items():
        assert f.metadata["help"] and shown[key].endswith(f"  {f.metadata['help']}"), key
    assert shown["parallel.ep.dispatch"].split()[1:3] == ["*all_to_all", "overlapped"]
    assert shown["parallel.ep.sm_carveout"].split()[1:3] == ["*0", "32"]


def test_min_lr_defaults_to_a_tenth_of_lr():
    assert load_config(None, ["--train.lr=1e-4"]).train.min_lr == pytest.approx(1e-5)
    assert load_config(None, ["--train.lr=1e-4", "--train.min_lr=0"]).train.min_lr == 0.0
    with pytest.raises(ValueError, match=r"train.min_lr must be between 0 and train.lr .*leave it out for a tenth"):
        load_config(None, ["--train.lr=1e-4", "--train.min_lr=1e-3"])


def test_plan_summary_and_the_cross_node_key(capsys):
    assert main(["plan", "--nnodes", "2", "--nproc-per-node", "2", "--summary"]) == 0
    text = capsys.readouterr().out
    assert "global shape" not in text and "model.layers.0" not in text
    assert "parameters:" in text and "estimated memory per rank" in text and "estimated communication" in text
    line = _error(capsys, ["plan", "--nnodes", "2", "--nproc-per-node", "4", "--parallel.ep_size=8"], code=2)
    assert "set parallel.allow_cross_node_ep=true" in line and "pass allow_cross_node_ep" not in line


def test_a_hub_id_as_tokenizer_and_a_missing_tracker_are_one_line(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    line = _error(capsys, [*ONE, "--data.tokenizer=Qwen/Qwen3-30B-A3B", f"--logging.output_dir={out}"], code=2)
    assert "data.tokenizer 'Qwen/Qwen3-30B-A3B' is not a local folder" in line
    assert "hf download Qwen/Qwen3-30B-A3B" in line and not out.exists()
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
    line = _error(capsys, [*ONE, "--logging.mlflow.experiment=e", f"--logging.output_dir={out}"], code=2)
    assert "logging.mlflow is set but mlflow is not installed: pip install 'moeshard-train[mlflow]'" in line


# ---- tracking and profiling --------------------------------------------------------------------------------------


class _FakeWandb(types.ModuleType):
    """``wandb.init(...)`` -> a run that records ``log`` and ``finish``."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            id = kwargs["id"] or "wandb-run-1"

            def log(self, data: dict, step: int) -> None:
                fake.logged.append((dict(data), step))

            def finish(self) -> None:
                fake.finished += 1

        return Run()


def _fake_mlflow() -> tuple[types.ModuleType, types.ModuleType, dict]:
    """``mlflow.MlflowClient`` and ``mlflow.entities`` over one in-memory store."""
    store: dict = {"experiments": {}, "runs": {}, "metrics": [], "params": {}, "dicts": {}, "uris": []}
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: (key, value, step)
    entities.Param = lambda key, value: (key, value)

    class Client:
        def __init__(self, tracking_uri: str) -> None:
            store["uris"].append(tracking_uri)

        def get_experiment_by_name(self, name):
            found = store["experiments"].get(name)
            return types.SimpleNamespace(experiment_id=found) if found else None

        def create_experiment(self, name, artifact_location=None):
            store["experiments"][name] = str(len(store["experiments"]) + 1)
            return store["experiments"][name]

        def create_run(self, experiment_id, run_name=None, tags=None):
            run_id = f"mlflow-run-{len(store['runs']) + 1}"
            store["runs"][run_id] = {"experiment": experiment_id, "name": run_name, "tags": tags, "status": "RUNNING"}
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

        def get_run(self, run_id):
            if run_id not in store["runs"]:
                raise RuntimeError(f"no run {run_id}")
            return store["runs"][run_id]

        def log_batch(self, run_id, metrics=(), params=()):
            store["metrics"] += [(run_id, *m) for m in metrics]
            store["params"].update(params)

        def log_dict(self, run_id, dictionary, artifact_file):
            store["dicts"][artifact_file] = dictionary

        def set_terminated(self, run_id):
            store["runs"][run_id]["status"] = "FINISHED"

    mlflow = types.ModuleType("mlflow")
    mlflow.MlflowClient = Client
    mlflow.entities = entities
    return mlflow, entities, store


def test_trackers_log_config_version_and_every_metric_profile_and_no_bar_in_a_file(capsys, tmp_path, monkeypatch):
    from moeshard.train.observe.tracking import code_version

    fake_wandb = _FakeWandb()
    mlflow, entities, store = _fake_mlflow()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    out = tmp_path / "out"
    track = ["--logging.wandb.project=p", "--logging.wandb.tags=[a]", "--logging.mlflow.experiment=e"]
    args = [*ONE, *track, "--logging.profile.steps=[2,3]", "--logging.progress_bar=true"]
    assert main([*args, f"--logging.output_dir={out}"]) == 0
    captured = capsys.readouterr()
    # stderr is no terminal here: no progress bar, and the per-step lines stay whole
    assert "train:" not in captured.err and "step/s" not in captured.err
    assert [ln.split("|")[0].split()[:2] for ln in captured.out.splitlines() if ln.startswith("step ")] == [
        ["step", "1"], ["step", "2"], ["step", "3"],
    ]  # fmt: skip

    # W&B: one run with the resolved config and the code version, then every scalar metrics.jsonl holds
    (init,) = fake_wandb.inits
    assert init["project"] == "p" and init["mode"] == "offline" and init["tags"] == ["a"] and init["dir"] == str(out)
    assert init["name"] == "out" and init["resume"] == "allow" and init["id"] is None
    code = code_version()
    assert init["config"]["code"] == code and init["config"]["train"] == load_config(None, args).to_dict()["train"]
    expected = [(_scalars(r), r["step"]) for r in _records(out)]
    assert len(expected) >= 3 and fake_wandb.logged == expected and fake_wandb.finished == 1
    # MLflow: the same scalars in one run, the flattened config as params, the version as tags
    (run_id,) = store["runs"]
    assert store["uris"][0] == f"sqlite:///{out.resolve() / 'mlflow.db'}"
    assert store["runs"][run_id]["status"] == "FINISHED" and store["runs"][run_id]["tags"]["moeshard.moeshard_train"]
    assert store["params"]["train.lr"] == "0.003" and store["dicts"]["config.yaml"]["train"]["steps"] == 3
    logged = {(key, step): value for _, key, value, step in store["metrics"]}
    assert logged == {(k, step): v for scalars, step in expected for k, v in scalars.items()}
    assert json.loads((out / "tracking.json").read_text()) == {"wandb": "wandb-run-1", "mlflow": run_id}

    # The profiler's Chrome trace of steps 2-3 (CPU ops)
    trace = out / "profile/steps_2-3_rank_00000.pt.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert f"profile of steps 2-3 written to {out / 'profile'}" in captured.out

    # A resumed run continues both tracked runs
    assert main([*args, "--train.steps=4", f"--logging.output_dir={out}"]) == 0
    assert fake_wandb.inits[1]["id"] == "wandb-run-1" and list(store["runs"]) == [run_id]
    assert fake_wandb.logged[-1][1] == 4 and ("loss", 4) in {(k, s) for _, k, _, s in store["metrics"]}


def test_code_version_names_the_git_commit_of_this_checkout():
    from moeshard.train.observe.tracking import code_version

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        pytest.skip("no git here")
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    version = code_version()
    assert version["git_commit"] == head.stdout.strip() and isinstance(version["git_dirty"], bool)
    assert version["moeshard_train"]


def test_real_trackers_in_their_offline_modes(capsys, tmp_path):
    import importlib.util

    have_wandb = importlib.util.find_spec("wandb") is not None
    have_mlflow = all(importlib.util.find_spec(m) is not None for m in ("mlflow", "sqlalchemy", "alembic"))
    if not (have_wandb or have_mlflow):
        pytest.skip("neither wandb nor mlflow is installed (pip install 'moeshard-train[wandb,mlflow]')")
    out = tmp_path / "out"
    track = (["--logging.wandb.mode=offline"] if have_wandb else []) + (
        ["--logging.mlflow=true"] if have_mlflow else []
    )
    os.environ.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")  # clean_env restores the environment
    assert main([*ONE, *track, "--train.steps=2", f"--logging.output_dir={out}"]) == 0
    ids = json.loads((out / "tracking.json").read_text())
    if have_wandb:
        runs = list((out / "wandb").glob(f"offline-run-*-{ids['wandb']}"))
        assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((out / "wandb").iterdir())
    if have_mlflow:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
        assert [m.step for m in client.get_metric_history(ids["mlflow"], "loss")] == [1, 2]
        assert client.get_run(ids["mlflow"]).data.params["train.steps"] == "2"


def test_launch_local_picks_a_free_port_below_the_ephemeral_range():
    """The agents' store port: never one the kernel hands to a bind of port 0 (a concurrent gloo or torchrun process
    could take it before the agents bind it), and never one already bound."""
    import random
    import socket

    from moeshard.train.cluster import launch_local

    top = min(launch_local._ephemeral_low(), 32768) - 1
    ports = {launch_local.rendezvous_port() for _ in range(20)}
    assert all(1024 <= p <= top for p in ports), ports
    with socket.socket() as held:  # a taken port is skipped: the same draws, with the first one bound elsewhere
        first = random.Random(7).randint(top - 12287, top)
        held.bind(("127.0.0.1", first))
        port = launch_local.rendezvous_port(random.Random(7))
        assert port != first and 1024 <= port <= top
