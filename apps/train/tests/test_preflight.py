"""One check of the config against the layout, three callers: training, ``plan`` and ``launch-local`` refuse the
same configs in the same words (config errors: exit status 2), ``launch-local`` before any worker starts; ``plan``
warns where its estimate exceeds a GPU's memory and names a regime that fits; the README's ``plan`` figures are
what ``plan`` prints."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeshard.train.__main__ import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ["--model.overrides.num_hidden_layers=2", "--data.seq_len=32"]
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env():
    saved = dict(os.environ)
    for k in _DIST_ENV + ("TORCHELASTIC_RESTART_COUNT",):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def no_workers(monkeypatch):
    """launch-local must not start an agent: any subprocess it would start fails the test."""
    import moeshard.train.cluster.launch_local as launch_local

    def refuse(*args, **kwargs):
        raise AssertionError(f"a worker was started: {args[0]}")

    monkeypatch.setattr(launch_local.subprocess, "Popen", refuse)


def _line(capsys, args: list[str], code: int = 2) -> str:
    assert main(args) == code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("moeshard-train: error: config: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("nnodes", "nproc", "args", "needle"),
    [
        (2, 2, ["--parallel.ep_size=3"], "ep_size 3 does not divide world size 4"),
        (2, 2, ["--parallel.ep_size=4"], "would cross a node boundary with 2 ranks per node"),
        (1, 4, ["--parallel.ep_size=4", "--model.overrides.num_experts=6"], "does not divide the model's 6 experts"),
        (2, 2, ["--train.global_batch_size=2"], "global_batch_size 2 is smaller than the 4 data-parallel ranks"),
        (2, 2, ["--train.global_batch_size=10"], "global_batch_size 10 is not divisible by the world size 4"),
        (
            1,
            2,
            ["--train.global_batch_size=8", "--train.micro_batch_size=3"],
            "not divisible by train.micro_batch_size",
        ),
        (1, 2, ["--data.seq_len=300"], "data.seq_len 300 exceeds the model's max_position_embeddings 256"),
        (1, 2, ["--model.overrides.no_such_field=1"], "no_such_field"),
        (1, 2, ["--model.path=/nonexistent/model"], "/nonexistent/model does not exist"),
    ],
)
def test_training_plan_and_launch_local_refuse_alike(capsys, tmp_path, no_workers, nnodes, nproc, args, needle):
    layout = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
    planned = _line(capsys, ["plan", *layout, "--summary", *TINY, *args])
    launched = _line(capsys, ["launch-local", *layout, "--", *TINY, *args])
    out = tmp_path / "out"
    os.environ.update({"RANK": "0", "WORLD_SIZE": str(nnodes * nproc), "LOCAL_WORLD_SIZE": str(nproc)})
    trained = _line(capsys, [*TINY, *args, f"--logging.output_dir={out}"])
    assert needle in planned
    assert planned == launched == trained
    assert not out.exists()


def test_launch_local_checks_only_training(no_workers, monkeypatch):
    """Another command of the job checks its own arguments (in the workers); help passes through."""
    from moeshard.train.cluster.launch_local import check_job

    check_job(["bench", "--layers", "2"], 2, 2)
    check_job(["--help"], 2, 2)
    check_job(["train", "--parallel.ep_size=2"], 2, 2)
    with pytest.raises(ValueError, match="unknown config key train.stepz"):
        check_job(["train", "--train.stepz=5"], 2, 2)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train.stepz=5"], "unknown config key train.stepz; did you mean train.steps?"),
        (["--parallel.ep_size=3"], "parallel.ep_size: ep_size 3 does not divide world size 4"),
    ],
)
def test_launch_local_fails_fast_in_one_line(tmp_path, args, needle):
    """The real command, as a user runs it: one line, exit status 2, in seconds (the agents' path took 12-34 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "2", "--nproc-per-node", "2", "--"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"moeshard-train: error: config: {done.stderr.split('config: ', 1)[1].strip()}"]
    assert needle in done.stderr and done.stdout == ""
    # CPU seconds, not wall seconds: the test machine is shared; a started agent and its workers alone would take more
    assert cpu < 10, (cpu, wall)


# ---- plan against a GPU's memory ---------------------------------------------------------------------------------

_EIGHT_LAYERS = [
    "--model.preset=qwen3-30b-a3b",
    "--model.overrides.num_hidden_layers=8",
    "--parallel.param_dtype=bfloat16",
    "--data.seq_len=4096",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=4",
    "--parallel.ep_size=2",
    "--parallel.activation_checkpointing=none",
]
GiB = 2**30


def _report(*extra: str, nnodes: int = 1, nproc: int = 2, gpu: float | None = None):
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    cfg = load_config(None, [*_EIGHT_LAYERS, *extra])
    return plan_report(cfg, nnodes=nnodes, nproc_per_node=nproc, table=False, gpu_memory=gpu and ("the test", gpu))


def test_plan_warns_and_names_the_first_regime_that_fits():
    base = _report()
    total = base.memory.total / GiB
    assert base.warning is None and _report(gpu=total + 0.01).warning is None
    # The regimes in the order plan tries them (least step time lost first), each planned on its own.
    order = [(ac, mb) for ac in ("selective", "full") for mb in (4, 2, 1)]
    figure = {
        r: _report(f"--parallel.activation_checkpointing={r[0]}", f"--train.micro_batch_size={r[1]}").memory.total / GiB
        for r in order
    }
    assert figure["full", 4] < figure["selective", 4] < total
    for limit in (total - 0.01, figure["selective", 4] - 0.01, figure["full", 4] + 0.01):
        report = _report(gpu=limit)
        first = next(r for r in order if figure[r] <= limit)
        flags = f"--parallel.activation_checkpointing={first[0]}" + (
            f" --train.micro_batch_size={first[1]}" if first[1] != 4 else ""
        )
        assert report.warning == (
            f"warning: the estimated peak {total:.2f} GiB exceeds the {limit:.2f} GiB of the test; fits with "
            f"{flags} ({figure[first]:.2f} GiB)"
        )
        assert report.warning in report.text


def test_plan_names_more_ranks_or_says_nothing_fits():
    # One GPU: no regime brings its parameters and AdamW state under the limit; a second node halves them.
    full = ("--parallel.ep_size=1", "--parallel.activation_checkpointing=full", "--train.micro_batch_size=1")
    least_on_two = _report(*full, nnodes=2, nproc=1)
    limit = least_on_two.memory.total / GiB + 0.01
    warning = _report("--parallel.ep_size=1", nproc=1, gpu=limit).warning
    flags, quoted = re.search(r"fits with --nnodes 2 ?(.*) \((\d+\.\d\d) GiB\)$", warning).groups()
    refit = _report("--parallel.ep_size=1", *flags.split(), nnodes=2, nproc=1).memory.total / GiB
    assert f"{refit:.2f}" == quoted and refit <= limit
    nothing = _report(gpu=0.01).warning
    assert "no regime tried fits" in nothing and nothing.endswith("plan a larger cluster")


def test_plan_command_takes_the_gpu_memory(capsys):
    args = ["plan", "--nnodes", "1", "--nproc-per-node", "2", "--summary", *_EIGHT_LAYERS, "--gpu-memory", "0.01"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "warning: the estimated peak" in out and "GiB of --gpu-memory; no regime tried fits" in out


# ---- the README's figures ----------------------------------------------------------------------------------------

_FIGURE = re.compile(
    r"^moeshard-train plan (?P<args>[^#]*?)\s+# (?P<gib>\d+\.\d) GiB per GPU(?P<rest>[^\n]*)", re.MULTILINE
)


def test_readme_plan_figures_are_what_plan_prints():
    """Every ``moeshard-train plan ... # N.N GiB per GPU`` line of the READMEs: ``plan``'s estimate, to the digit."""
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    found = [
        (path, m)
        for path in (ROOT / "README.md", ROOT / "apps/train/README.md")
        for m in _FIGURE.finditer(path.read_text())
    ]
    # the Qwen3-30B-A3B on 8 and 16 GPUs, the DeepSeek-V3 16B on 8; with LoRA the 235B on 8 (and without), the 30B;
    # long rows: the 30B at 128k at sp 1 and 8, the DeepSeek-V3 16B at 64k at sp 1 and 8
    assert len(found) >= 10
    for path, m in found:
        words = m["args"].split()
        config = ROOT / words[words.index("--config") + 1]
        nnodes, nproc = int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc-per-node") + 1])
        overrides = [w for w in words if w.startswith("--") and "=" in w]
        gpu = ("--gpu-memory", float(words[words.index("--gpu-memory") + 1])) if "--gpu-memory" in words else None
        cfg = load_config(config, overrides)
        report = plan_report(cfg, nnodes=nnodes, nproc_per_node=nproc, table=False, gpu_memory=gpu)
        assert f"{report.memory.total / GiB:.1f}" == m["gib"], (path.name, m.group(0), report.memory.total / GiB)
        if gpu is not None:  # the line says what plan's check against the GPU says
            said = "does not fit" if "does not fit" in m["rest"] else "fits" if "fits" in m["rest"] else None
            assert said == ("does not fit" if report.warning else "fits"), (m.group(0), report.warning)
        smallest = re.search(r"the smallest sp: (\d+), (\w+) checkpointing", m["rest"])
        if smallest:  # the line names what plan's context line names
            c = report.context
            assert c is not None and c.fits, (m.group(0), c)
            assert (str(c.sp_size), c.activation_checkpointing) == smallest.groups(), (m.group(0), c)
        if "(full fine-tuning)" in m["rest"]:
            assert not cfg.lora.enabled, m.group(0)
