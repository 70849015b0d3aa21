"""The tools in ``benchmarks/`` run on today's tree: each one on CPU with tiny arguments.

The shell scripts launch ``python3 -m torch.distributed.run ... -m moeshard.train bench FLAGS`` on a GPU. Here a
``python3`` put first on PATH (:data:`SHIM`) stands in for torchrun and hands bench's part of that command line to
the real interpreter, either

- ``run``: bench itself in one CPU process, with the tiny model and short steps appended (later flags win), so the
  script's whole path (bench, its JSON, the table at the end) runs; or
- ``check``: the launch is only recorded; the test then gives each recorded command line to bench's own parser and
  the job's config loader at the launch's world size (an unknown flag or key is refused there as bench would
  refuse it), without running steps: for the scripts whose layouts need two GPUs or a GPU's disk and kernels.

Any other ``python3`` call of a script goes to the real interpreter unchanged.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TIMEOUT = 300

# What every tool in benchmarks/ is and which test runs it: a new file there needs a line here and a test.
TOOLS = {
    "before_after_1gpu.sh": "test_before_after_1gpu",
    "regimes_1gpu.sh": "test_regimes_1gpu",
    "steady_idle.sh": "test_steady_idle",
    "table.sh": "test_table_and_compare",
    "compare.sh": "test_table_and_compare",
    "checkpoint_cost.sh": "test_checkpoint_cost",
    "documents.sh": "test_documents",
    "gpu_env.sh": "test_steady_idle",  # sourced by steady_idle.sh and table.sh
    "fa4_env.sh": "test_fa4_env",
    "bench_table.py": "test_regimes_1gpu",
    "trace_summary.py": "test_trace_summary",
    "host_gaps.py": "test_host_gaps",
    "prefetch_profile.py": "test_prefetch_profile",  # the prefetch package README's GPU profile
    "balancing.py": "test_balancing_help",  # its curves: apps/train/tests/test_balancing.py
    "balancing.json": "test_balancing_help",  # balancing.py's output, the app README's figure
    "balancing.svg": "test_balancing_help",
    "lora_cost.py": "test_lora_cost",
    "figures_1gpu.sh": "test_figures_1gpu",
}

# The tiny CPU job appended to bench's flags in "run" mode.
CPU_JOB = [
    "--model.preset=tiny",
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=64",
    "--parallel.compile=false",
    "--parallel.ep.kernels=eager",
    "--parallel.ep_size=1",
    "--steps",
    "3",
    "--warmup",
    "1",
]

SHIM = textwrap.dedent(
    '''\
    #!{python}
    """python3 for the benchmark scripts on CPU (tests/test_benchmarks.py)."""
    import json, os, sys

    args = sys.argv[1:]
    if args[:2] != ["-m", "torch.distributed.run"]:
        os.execv(sys.executable, [sys.executable, *args])
    rest, world = args[2:], 1
    while rest[0] != "-m":  # torchrun's own options
        opt = rest.pop(0)
        if opt.startswith("--nproc-per-node"):
            world = int(opt.split("=", 1)[1]) if "=" in opt else int(rest.pop(0))
    program, command, flags = rest[1], rest[2], rest[3:]
    assert (program, command) == ("moeshard.train", "bench"), rest
    with open(os.environ["SHIM_LOG"], "a") as log:
        log.write(json.dumps({{"world": world, "flags": flags}}) + "\\n")
    if os.environ["SHIM_MODE"] == "run":
        extra = json.loads(os.environ["SHIM_CPU_JOB"])
        os.execv(sys.executable, [sys.executable, "-m", "moeshard.train", "bench", *flags, *extra])
    print("launched:", " ".join(flags))
    '''
)


def _run_script(tmp_path: Path, script: str, mode: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    """``bash benchmarks/<script>`` from the repository root with the shim's python3; (the process, the launches)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "python3"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    log = tmp_path / "launches.jsonl"
    out = tmp_path / "out"
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "OMP_NUM_THREADS": "1",
        "SHIM_MODE": mode,
        "SHIM_LOG": str(log),
        "SHIM_CPU_JOB": json.dumps(CPU_JOB),
        **env,
    }
    res = subprocess.run(
        ["bash", str(BENCH / script)], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=TIMEOUT
    )
    launches = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    assert res.returncode == 0, f"{script} failed:\n{res.stdout}\n{res.stderr}"
    return res, launches


def _check(launches: list[dict]) -> None:
    """Each recorded bench command line through bench's parser and the job's config, as bench would take it."""
    from moeshard.train.commands.bench import _job_config, _parse_args

    for launch in launches:
        try:
            parsed, overrides = _parse_args(launch["flags"])
            _job_config(parsed, overrides, launch["world"])
        except (SystemExit, ValueError) as e:
            pytest.fail(f"bench refuses {' '.join(launch['flags'])}: {e!r} (see the error above)")


def test_every_tool_has_a_test():
    present = {p.name for p in BENCH.iterdir() if p.is_file()}
    missing = sorted(present - set(TOOLS))
    assert not missing, f"benchmarks/ holds {missing} with no smoke test: add each to TOOLS in {__file__} with a test"
    gone = sorted(set(TOOLS) - present)
    assert not gone, f"TOOLS names {gone}, which benchmarks/ no longer holds: remove them from TOOLS"
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(TOOLS.values()) <= tests


def test_no_tool_imports_a_private_module():
    for path in sorted(BENCH.glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split()
            if words[:1] in (["from"], ["import"]) and len(words) > 1 and words[1].startswith("moeshard."):
                private = [part for part in words[1].split(".") if part.startswith("_")]
                assert not private, f"{path.name}:{i} imports a private module ({line.strip()}): use the public API"


def test_regimes_1gpu(tmp_path):
    res, launches = _run_script(tmp_path, "regimes_1gpu.sh", "run", RUNS="mb2_full", T="240")
    assert len(launches) == 1 and "--parallel.activation_checkpointing=full" in launches[0]["flags"]
    assert (tmp_path / "out" / "new_mb2_full.json").exists(), res.stdout + res.stderr
    table = res.stdout.splitlines()
    assert any(line.startswith("new_mb2_full") for line in table), res.stdout  # bench_table.py's line


def test_steady_idle(tmp_path):
    # No trace is written here (bench records GPU activity only): the script says so and goes on to the next run.
    res, launches = _run_script(tmp_path, "steady_idle.sh", "check", MBS="1 4", ACS="selective")
    assert len(launches) == 2 and all("--trace-gpu-only" in launch["flags"] for launch in launches)
    _check(launches)
    assert res.stdout.count("no trace written") == 2, res.stdout


def test_before_after_1gpu(tmp_path):
    res, launches = _run_script(tmp_path, "before_after_1gpu.sh", "check", OLD=str(ROOT), MBS="1")
    assert len(launches) == 3, res.stdout  # the old tree, the new one with the old defaults, the new one
    _check(launches)


def test_table_and_compare(tmp_path):
    res, launches = _run_script(tmp_path, "table.sh", "check")
    assert [launch["world"] for launch in launches] == [2, 2, 2, 1]
    _check(launches)
    (tmp_path / "compare").mkdir()
    res, launches = _run_script(tmp_path / "compare", "compare.sh", "check", OLD=str(ROOT), ROUNDS="a")
    assert len(launches) == 4 and all(launch["world"] == 2 for launch in launches)
    _check(launches)
    assert "tokens/s/GPU" in res.stdout  # the summary's header (no JSON: no steps ran)


def test_checkpoint_cost(tmp_path):
    res, launches = _run_script(tmp_path, "checkpoint_cost.sh", "check", DISK="0", DIR=str(tmp_path / "saves"))
    assert len(launches) == 2 and "--checkpoint.async=true" in launches[1]["flags"]
    _check(launches)


def test_documents(tmp_path):
    res, launches = _run_script(tmp_path, "documents.sh", "check", CORPUS=str(tmp_path / "corpus"))
    assert len(launches) == 4 and "--preload" in launches[3]["flags"]
    _check(launches)
    (tmp_path / "plain").mkdir()
    res, launches = _run_script(tmp_path / "plain", "documents.sh", "check", CORPUS="")
    assert len(launches) == 2 and "CORPUS not set" in res.stdout


def test_fa4_env(tmp_path):
    (tmp_path / "empty").mkdir()
    res = subprocess.run(
        ["bash", "-c", f"source benchmarks/fa4_env.sh {tmp_path / 'empty'}; echo rc=$?"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "rc=1" in res.stdout, res.stdout + res.stderr  # no archive in the folder: refused, nothing exported


def _kernel(name: str, ts: float, dur: float, tid: int = 7, corr: int | None = None) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 0,
        "tid": tid,
        "args": {"correlation": corr} if corr is not None else {},
    }


def _trace(path: Path) -> Path:
    """Three steps of 30 ms: a GEMM, an idle gap of 10 ms while the host runs the optimizer's op, the optimizer's
    kernel; an NCCL kernel on another stream; the launches of the compute stream's kernels."""
    events = []

    def launch(ts: float, corr: int) -> dict:
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "ts": ts,
            "dur": 5,
            "pid": 1,
            "tid": 1,
            "args": {"correlation": corr},
        }

    for step in range(3):
        t = step * 30_000.0
        events += [_kernel("sm90_gemm", t + 1_000, 9_000, corr=10 * step), launch(t + 500, 10 * step)]
        events.append(_kernel("nccl_allgather", t, 1_000, tid=9))
        events += [_kernel("multi_tensor_apply_adamw", t + 20_000, 5_000, corr=10 * step + 1)]
        events.append(launch(t + 19_500, 10 * step + 1))
        events.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::_fused_adamw_",
                "ts": t + 12_000,
                "dur": 6_000,
                "pid": 1,
                "tid": 1,
                "args": {},
            }
        )
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_trace_summary(tmp_path):
    trace = _trace(tmp_path / "t.json.gz")
    cmd = [sys.executable, str(BENCH / "trace_summary.py"), str(trace), "--top", "5", "--steps-between", "adamw"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # three optimizer passes: the two steps between the first and the last pass's end, each kernel once a step
    assert "2 whole step(s) between optimizer ends" in res.stdout, res.stdout
    assert "18.00 ms     2x (1/step)  sm90_gemm" in res.stdout, res.stdout


def test_host_gaps(tmp_path):
    trace = _trace(tmp_path / "t.json.gz")
    cmd = [sys.executable, str(BENCH / "host_gaps.py"), str(trace), "--min-gap-ms", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # gaps of 10, 6, 10, 6, 10 ms; the optimizer's op (6 ms) inside each of the three launches after a GEMM
    assert "5 host-bound gaps > 1.0 ms, 42.0 ms in all" in res.stdout, res.stdout
    assert "18.00 ms  aten::_fused_adamw_" in res.stdout, res.stdout


def test_prefetch_profile(tmp_path):
    """Its CPU path (gloo, one rank, the tiny preset): a step time per prefetch depth, in the JSON."""
    out = tmp_path / "prefetch.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(BENCH / "prefetch_profile.py"), "--preset", "tiny", "--seq-len", "32", "--layers", "2",
        "--depths", "0,1", "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["depth"] for r in results] == [0, 1] and all(r["step_s_median"] > 0 for r in results)


def test_balancing_help():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run(
        [sys.executable, str(BENCH / "balancing.py"), "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 0 and "--steps" in res.stdout, res.stderr
    curves = json.loads((BENCH / "balancing.json").read_text())
    assert curves and (BENCH / "balancing.svg").read_text().startswith("<svg")


def test_figures_1gpu(tmp_path):
    jobs = "full lora s4k s16k s32k s64k s128k l128k q3 oss q35".split()
    res, launches = _run_script(tmp_path, "figures_1gpu.sh", "check", JOBS=" ".join(jobs), LAYERS="2")
    assert len(launches) == len(jobs), res.stdout + res.stderr
    _check(launches)
    by_job = dict(zip(jobs, (launch["flags"] for launch in launches)))
    assert all("--model.overrides.num_hidden_layers=2" in flags for flags in by_job.values())
    assert "--lora.rank=16" in by_job["lora"] and "--lora.rank=16" not in by_job["full"]
    tokens = {
        j: int(next((f for f in by_job[j] if f.startswith("--data.seq_len=")), "=4096").split("=")[1]) for j in jobs
    }
    rows = {j: int(by_job[j][by_job[j].index("--batch-per-gpu") + 1]) for j in ("s4k", "s16k", "s32k", "s64k")}
    assert {tokens[j] * rows[j] for j in rows} == {65536}  # the same tokens per step up to 64k
    assert tokens["s128k"] == 131072 and "--parallel.activation_checkpointing=full" in by_job["s128k"]
    assert "--model.preset=gpt-oss-20b" in by_job["oss"] and "--model.preset=qwen3.5-35b-a3b" in by_job["q35"]
    res, launches = _run_script(tmp_path, "figures_1gpu.sh", "run", JOBS="full")  # the whole path: bench, the table
    assert (tmp_path / "out" / "full_mb4.json").exists(), res.stdout + res.stderr
    assert any(line.startswith("full_mb4") for line in res.stdout.splitlines()), res.stdout


def test_lora_cost(tmp_path):
    """benchmarks/lora_cost.py --smoke: the frozen experts and attention projections, without and with adapters,
    each timed (forward + backward) and the adapters' share printed and written."""
    out = tmp_path / "cost.json"
    res = subprocess.run(
        [sys.executable, str(BENCH / "lora_cost.py"), "--smoke", "--json", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    lines = res.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["experts", "attention"]
    assert all("with rank-8 adapters" in line and "adapters' share" in line for line in lines)
    figures = json.loads(out.read_text())
    for name in ("experts", "attention"):
        base, lora = figures[f"{name}_ms"], figures[f"{name}_lora_ms"]
        assert base > 0 and lora > 0
        assert figures[f"{name}_adapter_share"] == pytest.approx((lora - base) / lora)
    assert figures["args"]["rank"] == 8 and figures["args"]["experts"] == 4
