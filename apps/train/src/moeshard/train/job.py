"""One training run: checks -> process group -> build -> resume -> the step loop with its callbacks -> summary.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml

A run resumes from the newest complete checkpoint with ``checkpoint.resume: auto`` (also after ``torchrun
--max-restarts`` restarts it) and then computes the same losses as an uninterrupted run. The loop itself is
:func:`moeshard.train.train.run`; this module chooses its callbacks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeshard.train import checkpoint as ckpt
from moeshard.train import faults
from moeshard.train.checks import prepare, print0, run_identity
from moeshard.train.comm_accounting import CommPerStep
from moeshard.train.config import JobConfig
from moeshard.train.errors import JobError, TrainingDiverged
from moeshard.train.metrics import MetricsLogger, ProgressBar, StepTimer
from moeshard.train.train import Callback, LossLog, StepStats, build, init_distributed, run


class StopOnNonFinite(Callback):
    """Stops the run before the update of a step whose loss or gradient norm is not finite (the step's one read of
    its stats happens here).

    Raises:
        TrainingDiverged: naming the step and the newest complete checkpoint, which is kept.
    """

    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir

    def before_update(self, step: int, stats: StepStats) -> None:
        loss, _, grad_norm = stats.read()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(
                f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; the parameters were not updated and "
                f"the last good checkpoint ({ckpt.newest_checkpoint(self.ckpt_dir) or 'none'}) is kept. "
                "Lower train.lr or check the data, then resume"
            )


def run_job(cfg: JobConfig) -> dict[str, Any]:
    """Run the job under torchrun (or as a single process); returns a summary on every rank.

    Returns:
        ``{"losses": [...] (steps run by this call), "start_step": int, "checkpoint": newest saved or None,
        "job": the trained Job (model, optimizer, meshes)}``.

    Raises:
        JobError: bad inputs, a diverged loss, a failed checkpoint save (every rank raises it alike).
    """
    prep = prepare(cfg)
    faults.configure(prep.output_dir, prep.rank)
    device = init_distributed()
    rank = dist.get_rank()
    try:
        torch.manual_seed(cfg.train.seed)
        job = build(cfg, device)
        print0(job.meshes.describe())
        start_step = 0
        if prep.resume_path is not None:
            start_step = ckpt.resume_job(job, prep.resume_path)
            print0(f"resumed from {prep.resume_path} at step {start_step}")
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from e
    if rank == 0:
        prep.output_dir.mkdir(parents=True, exist_ok=True)
        (prep.output_dir / "run.json").write_text(json.dumps(run_identity(cfg), indent=1))
        (prep.output_dir / "config.yaml").write_text(_yaml(cfg))

    # Callbacks run in this order at each hook: the step's read of its stats and the checks before its update
    # first, the measurements before the metrics that log them, the checkpoint last.
    checkpointer = ckpt.Checkpointer(job, prep.ckpt_dir)
    bar = ProgressBar(cfg.train.steps, start_step) if rank == 0 and cfg.logging.progress_bar else None
    callbacks: list[Callback] = [
        faults.FaultInjection(job.model),
        StopOnNonFinite(prep.ckpt_dir),
        StepTimer(restart_after=checkpointer.due),
        *([CommPerStep(job.meshes, prep.ranks_per_node)] if cfg.logging.comm_accounting else []),
        MetricsLogger(job, prep.output_dir, enabled=rank == 0, start_step=start_step, console=bar and bar.write),
        *([bar] if bar else []),
        checkpointer,
    ]

    def batches(step: int) -> list:
        return [prep.data.collate(ix) for ix in prep.batches.micro_batches(step, rank)]

    losses = LossLog()
    run(job, batches, [*callbacks, losses], start_step=start_step)
    return {
        "losses": losses.losses,
        "start_step": start_step,
        "checkpoint": str(checkpointer.last_saved) if checkpointer.last_saved else None,
        "job": job,
    }


def _yaml(cfg: JobConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
