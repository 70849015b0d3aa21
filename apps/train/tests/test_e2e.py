"""The real entry point under torchrun: two "nodes" on localhost, restarts after SIGKILL, a diverging run.

1. ``moeshard-train launch-local --nnodes 2 --nproc-per-node 2`` (two torchrun agents, 4 gloo ranks, EP 2 inside a
   node, expert FSDP across nodes) trains the embedded default (2 layers, seq 32) with communication accounting:
   metrics.jsonl keys and a falling loss, TensorBoard scalars and the expert-load heatmap, all-to-all bytes only
   inside a node, only FSDP all-gather / reduce-scatter (and scalar all-reduces) across nodes, and the ``plan``
   estimate of the same figures (all-gather and reduce-scatter within 2 %, all-to-all inside its bounds).
2. The same job with ``--max-restarts 2``, one rank SIGKILLed while saving step 4 and another in step 5: torchrun
   restarts it twice, it resumes from steps 2 and 4 and ends with the losses of run 1.
3. A NaN loss at step 3 under plain torchrun: one clear line on the console, no traceback, exit status 1, the
   checkpoint of step 2 kept.
4. ``bench`` under torchrun: every figure it reports.

The four are independent and start at once (the ``jobs`` fixture): their start-ups, rendezvous and restarts
overlap.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from moeshard.meshes.testing import run_side_by_side

pytestmark = pytest.mark.slow

JOB = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.steps=6",
    "--checkpoint.every_steps=2",
    "--logging.expert_load_every=2",
]
KEYS = {"step", "loss", "aux_loss", "grad_norm", "lr", "tokens_per_s_per_gpu", "max_memory_gib"}  # no mfu on CPU


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeshard.train", *args]


def _torchrun(*args: str) -> list[str]:
    """Plain ``torchrun --standalone`` of the job, 2 ranks."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return [*torchrun, "-m", "moeshard.train", *args]


def _records(out: Path) -> list[dict]:
    """The training steps' records (the evaluations' have ``val_loss`` instead of ``loss``)."""
    return [r for r in _all_records(out) if "loss" in r]


def _all_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """The file's four jobs, started at once (independent: their start-ups, rendezvous and restarts overlap); each
    one's :class:`subprocess.CompletedProcess` (stdout and stderr) once all have ended, and ``root``, their folder."""
    root = tmp_path_factory.mktemp("job")
    launch = ["launch-local", "--nnodes", "2", "--nproc-per-node", "2"]
    commands = {
        "reference": (
            _train(*launch, "--", *JOB, "--logging.comm_accounting=true", f"--logging.output_dir={root / 'ref'}"),
            {},
        ),
        "restarted": (
            _train(*launch, "--max-restarts", "2", "--", *JOB, f"--logging.output_dir={root / 'restarted'}"),
            {"MOESHARD_FAULT": "kill_rank:1:during_save:4,kill_rank:2:step:5"},
        ),
        "nan": (
            _torchrun("--model.overrides.num_hidden_layers=2", "--data.seq_len=32", "--train.steps=4")
            + ["--checkpoint.every_steps=1", "--checkpoint.keep_last=1", f"--logging.output_dir={root / 'nan'}"],
            {"MOESHARD_FAULT": "nan_loss:1:step:3"},
        ),
        "bench": (
            _torchrun("bench", "--model.preset=tiny", "--model.overrides.num_hidden_layers=2", "--data.seq_len=32")
            + ["--parallel.ep_size=2", "--steps", "4", "--warmup", "1", "--out", str(root / "bench.json")],
            {},
        ),
    }
    results = run_side_by_side(
        *(cmd for cmd, _ in commands.values()),
        timeout=600,
        env=[{**os.environ, "OMP_NUM_THREADS": "1", **env} for _, env in commands.values()],
    )
    return {"root": root, **dict(zip(commands, results))}


@pytest.fixture(scope="module")
def reference(jobs) -> Path:
    res, out = jobs["reference"], jobs["root"] / "ref"
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "world 4 = 2 node(s) x 2 ranks; ep 2 x ep_fsdp 2" in res.stdout
    assert "Traceback" not in res.stdout + res.stderr
    (out.parent / "ref.stdout").write_text(res.stdout)
    return out


def test_two_nodes_metrics_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recs = _records(reference)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert all(KEYS <= set(r) for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.3
    assert recs[0]["lr"] == pytest.approx(3e-3 / 5)  # the lr the step used (warm-up step 1 of 5)
    acc = EventAccumulator(str(reference / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    assert KEYS - {"step"} <= set(tags["scalars"])
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in recs])
    assert {"expert_load/max_over_mean/layer_0", "expert_load/max_over_mean/layer_1"} <= set(tags["scalars"])
    assert "comm/all_to_all/ep/bytes" in tags["scalars"]
    # tokens seen per data source, cumulative: 16 rows of 32 per step
    assert [r["tokens_seen"] for r in recs] == [{"synthetic": 16 * 32 * s} for s in range(1, 7)]
    assert [e.value for e in acc.Scalars("tokens_seen/synthetic")] == [16 * 32 * s for s in range(1, 7)]
    heat = acc.Images("expert_load/heatmap")
    assert [e.step for e in heat] == [2, 4, 6]
    assert (heat[0].height, heat[0].width) == (2, 8)  # layers x experts
    ckpts = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert ckpts == ["step_00000004", "step_00000006"]  # keep_last 2
    # The global expert load (all ranks' counts) every expert_load_every steps, in metrics.jsonl too.
    loads = {r["step"]: r["expert_load"]["max_over_mean"] for r in recs if "expert_load" in r}
    assert set(loads) == {2, 4, 6} and all(set(v) == {"layer_0", "layer_1"} for v in loads.values())
    assert all(1.0 <= x <= 4.0 for v in loads.values() for x in v.values())  # top-2 of 8: at most 4
    # The default job's evaluation: before the first update and after the last step, 2 global batches of 16 x 31.
    val = [r for r in _all_records(reference) if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 6] and val[1]["val_loss"] < val[0]["val_loss"]
    assert all(r["val_tokens"] == 2 * 16 * 31 and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in val)
    assert [e.step for e in acc.Scalars("val_loss")] == [0, 6]
    stdout = (reference.parent / "ref.stdout").read_text()
    assert "eval      0 | val_loss" in stdout and "tok/s/gpu (predicted)" in stdout
    assert "checkpoint of step 4: " in stdout and "MiB, " in stdout
    assert "done: steps 1-6 (6 in this run) | 2,976 predicted tokens | wall " in stdout


def test_comm_accounting_stays_in_its_links_and_matches_plan(reference):
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    comm = _records(reference)[-1]["comm"]
    per_kind: dict[tuple[str, str], float] = {}
    lines = []
    for key, c in comm.items():
        kind, group = key.split("/")
        lines.append(f"{key:24s} {c['bytes'] / 1024:9.1f} KiB/step/rank, {c['inter_node_bytes'] / 1024:9.1f} inter")
        if kind in ("all_to_all", "send"):  # the EP exchange: split sizes by all-to-all, rows by batched sends
            assert group == "ep" and c["bytes"] > 0 and c["inter_node_bytes"] == 0, key
        elif c["inter_node_bytes"] > 0:
            fsdp_traffic = kind in ("all_gather", "reduce_scatter") and group in ("fsdp", "ep_fsdp")
            # the step's scalars (loss, token counts, grad norm) and its expert counts (2 layers x 8 float32, 64
            # bytes); an all-reduce sends up to twice its tensor
            scalars = kind == "all_reduce" and c["max_call_bytes"] <= 2 * 64
            assert fsdp_traffic or scalars, (key, c)
        if kind != "all_reduce":
            per_kind[(kind, "inter-node")] = per_kind.get((kind, "inter-node"), 0.0) + c["inter_node_bytes"]
            per_kind[(kind, "intra-node")] = (
                per_kind.get((kind, "intra-node"), 0.0) + c["bytes"] - c["inter_node_bytes"]
            )
    print("\n".join(lines))
    assert comm["all_gather/ep_fsdp"]["inter_node_bytes"] == comm["all_gather/ep_fsdp"]["bytes"] > 0

    cfg = load_config(None, [*JOB, "--parallel.param_dtype=float32"])  # CPU computes in float32
    report = plan_report(cfg, nnodes=2, nproc_per_node=2)
    for key in [k for k in report.comm if k[0] in ("all_gather", "reduce_scatter")]:
        assert per_kind[key] == pytest.approx(report.comm[key], rel=0.02), key
    measured = per_kind[("all_to_all", "intra-node")] + per_kind.get(("send", "intra-node"), 0.0)
    assert (
        0.5 * report.comm[("all_to_all", "intra-node")] <= measured <= report.comm_bound[("all_to_all", "intra-node")]
    )
    assert per_kind.get(("all_to_all", "inter-node"), 0.0) == per_kind.get(("send", "inter-node"), 0.0) == 0


def test_restart_after_sigkill_in_save_and_in_step(reference, jobs):
    out, res = jobs["root"] / "restarted", jobs["restarted"]
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    assert sorted(p.name for p in (out / ".faults_fired").iterdir()) == [
        "kill_rank:1:during_save:4",
        "kill_rank:2:step:5",
    ]
    assert f"resumed from {out}/checkpoints/step_00000002 at step 2" in log  # the step-4 save never completed
    assert f"resumed from {out}/checkpoints/step_00000004 at step 4" in log
    assert not re.search(r'File ".*moeshard', log)  # ranks that lost a peer say so in one line
    want = [r["loss"] for r in _records(reference)]
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in _records(out)] == pytest.approx(want, rel=1e-6)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]


def test_nan_loss_stops_with_one_message_and_keeps_the_checkpoint(jobs):
    out, res = jobs["root"] / "nan", jobs["nan"]
    log = res.stdout + res.stderr
    assert res.returncode != 0
    errors = [line for line in log.splitlines() if line.startswith("moeshard-train: error")]
    assert len(errors) == 1, log[-4000:]
    assert "step 3: non-finite loss nan" in errors[0] and "step_00000002" in errors[0]
    # No rank printed a traceback (torchrun's own summary below names the same message as the root cause).
    assert not re.search(r'File ".*moeshard', log) and not re.search(r"^\[rank\d", log, re.M)
    assert "traceback : step 3: non-finite loss" in log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    assert [r["step"] for r in _records(out)] == [1, 2]


def test_bench_reports_every_figure(jobs):
    # The benchmark's CPU path end to end (tiny geometry, EP 2 on gloo): a step time per timed step, the losses of
    # every step (random tokens: finite, near log(vocab)), and the figures the README table quotes.
    out, res = jobs["root"] / "bench.json", jobs["bench"]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["step_times_s"]) == 3 and all(t > 0 for t in result["step_times_s"])
    assert result["step_time_s_median"] == sorted(result["step_times_s"])[1]
    assert result["tokens_per_s_per_gpu"] == pytest.approx(4 * 32 / result["step_time_s_median"])
    assert len(result["losses"]) == 4 and all(0 < x < 20 for x in result["losses"])
    assert (result["ep_size"], result["ep_fsdp_size"], result["world_size"]) == (2, 1, 2)
    # on CPU every step runs synchronously anyway; on a GPU machine the steps run back to back
    assert result["timing"].startswith("back to back" if torch.cuda.is_available() else "isolated")
    assert "tok/s/GPU" in res.stdout
