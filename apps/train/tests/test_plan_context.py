"""``plan --gpu-memory`` names the smallest sp (and the checkpointing) at which the job's rows fit a GPU, in one
line, or says that none does on these GPUs; the figure it quotes is the estimate of a job built at that sp."""

from __future__ import annotations

import pytest

from moeshard.train.commands.plan import plan_report
from moeshard.train.commands.plan_memory import GiB
from moeshard.train.config import load_config

# tiny: 4 query heads, so sp 1, 2 and 4 on a node of 4; long rows make the activations what decides
_JOB = [
    "--model.preset=tiny",
    "--parallel.ep_size=2",
    "--data.seq_len=8192",
    "--model.overrides.max_position_embeddings=8192",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=1",
    "--parallel.activation_checkpointing=selective",
]


def _report(*extra, gib=None):
    cfg = load_config(None, [*_JOB, *extra])
    return plan_report(cfg, nnodes=1, nproc_per_node=4, table=False, gpu_memory=None if gib is None else ("x", gib))


def _context_lines(report):
    return [ln for ln in report.text.splitlines() if ln.startswith("context:")]


def _total(sp, ac="selective"):
    return _report(f"--parallel.sp_size={sp}", f"--parallel.activation_checkpointing={ac}").memory.total


@pytest.fixture(scope="module")
def estimates():
    """The estimate of the job built at sp 1, 2 and 4 (each its own build), with full and the job's selective
    checkpointing."""
    return {(sp, ac): _total(sp, ac) for sp in (1, 2, 4) for ac in ("selective", "full")}


def test_names_the_smallest_sp_that_fits(estimates):
    # the rows' activations shrink with the shard; full checkpointing holds less than selective at each sp
    assert estimates[1, "full"] > estimates[2, "full"] > estimates[4, "full"]
    assert all(estimates[sp, "full"] < estimates[sp, "selective"] for sp in (1, 2, 4))
    # less than sp 1 holds in any regime (full checkpointing, micro-batch 1: its least), more than sp 2 with full
    gib = (estimates[1, "full"] + estimates[2, "full"]) / 2 / GiB
    report = _report(gib=gib)
    c = report.context
    assert c is not None and c.fits
    assert (c.sp_size, c.activation_checkpointing, c.micro_batch_size) == (2, "full", 1)
    assert c.flags == "--parallel.sp_size=2 --parallel.activation_checkpointing=full"
    # the figure is the estimate of the job built at that sp in that regime, not a formula beside it
    assert c.total == estimates[2, "full"]
    (line,) = _context_lines(report)
    assert line == (
        f"context: rows of 8192 tokens fit {gib:.2f} GiB per GPU from sp 2 (full activation checkpointing, "
        f"micro-batch 1: {c.total / GiB:.2f} GiB): --parallel.sp_size=2 --parallel.activation_checkpointing=full"
    )
    # the job at sp 1 does not fit: its warning names the same regime
    assert report.warning is not None and report.warning.endswith(f"fits with {c.flags} ({c.total / GiB:.2f} GiB)")


def test_prefers_the_job_checkpointing_at_the_smallest_sp(estimates):
    # a limit that sp 2 fits with the job's checkpointing and sp 1 with full: the smaller sp wins
    limit = max(estimates[2, "selective"], estimates[1, "full"])
    assert limit < estimates[1, "selective"]
    c = _report(gib=(limit + 1e-6) / GiB).context
    assert (c.sp_size, c.activation_checkpointing, c.flags) == (1, "full", "--parallel.activation_checkpointing=full")
    c = _report("--parallel.sp_size=4", gib=estimates[1, "selective"] * 1.01 / GiB).context
    assert (c.sp_size, c.activation_checkpointing, c.flags) == (1, "selective", "--parallel.sp_size=1")


def test_a_job_that_already_fits_says_so(estimates):
    report = _report(gib=estimates[1, "selective"] / GiB + 1)
    (line,) = _context_lines(report)
    assert report.context.sp_size == 1 and line.endswith(": the job as configured") and report.warning is None


def test_says_when_no_sp_fits_on_these_gpus(estimates):
    report = _report(gib=0.001)
    c = report.context
    assert c is not None and not c.fits
    (line,) = _context_lines(report)
    assert "at no sp on these 4 GPUs" in line and "use more GPUs or a shorter data.seq_len" in line
    assert "sp up to 4" in report.warning  # the warning's list of what was tried says so too


def test_an_sp_the_heads_refuse_is_not_tried():
    # 4 query heads: on a node of 8 ranks, sp 8 is refused by training, so plan never names it
    cfg = load_config(None, [*_JOB, "--train.global_batch_size=8"])
    report = plan_report(cfg, nnodes=1, nproc_per_node=8, table=False, gpu_memory=("x", 0.001))
    assert report.context.sp_size in (1, 2, 4)
