"""One training run, each stage handing its result to the next: ``prepare(cfg)`` (the checks; the model config is
resolved once, there) -> process group -> output-directory lock -> ``build(cfg, device, prep.model_config)`` ->
resume -> ``run(job, ...)``, the step loop with its callbacks -> summary. SIGTERM / SIGUSR1 end the loop after a saved step (``moeshard.train.cluster.preemption``).

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml

A run resumes from the newest complete checkpoint with ``checkpoint.resume: auto`` (also after ``torchrun
--max-restarts`` restarts it) and then computes the same losses as an uninterrupted run: the rows of a step are a
pure function of the step (``moeshard.data.StepBatches``), whatever the layout. The loop itself is
:func:`moeshard.train.run.run`, fed by a ``moeshard.data.PrefetchLoader`` (the next steps' batches are prepared
in a background thread, pinned on CUDA); this module chooses its callbacks.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from moeshard import checkpoint as ckpt
from moeshard.data import PrefetchLoader
from moeshard.train._torch_internals import default_store
from moeshard.train.checkpointer import Checkpointer, resume_job, write_adapter
from moeshard.train.cluster import preemption
from moeshard.train.cluster.preemption import StopOnSignal
from moeshard.train.config import JobConfig
from moeshard.train.errors import JobError, TrainingDiverged
from moeshard.train.observe import tracking
from moeshard.train.observe.comm_accounting import CommPerStep
from moeshard.train.observe.metrics import MetricsLogger, ProgressBar, RunTotals, StepTimer, TokensPerSource
from moeshard.train.observe.profiling import Profiler
from moeshard.train.run import Callback, Job, LossLog, StepStats, build, faults, init_distributed, run, schedule_change
from moeshard.train.run.evaluation import Evaluator
from moeshard.train.run.prepare import Prepared, prepare, print0
from moeshard.train.run.startup import startup_block


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


class Heartbeat(Callback):
    """Tells the hang watchdog (``moeshard.checkpoint.HangWatchdog``, ``train.timeout_s``) that this rank finished
    a step, after everything that runs at its end (last in the list: after a save or an evaluation)."""

    def __init__(self, watchdog: ckpt.HangWatchdog) -> None:
        self.watchdog = watchdog

    def on_step_end(self, step: int, stats: StepStats) -> None:
        self.watchdog.beat(step)


def _watchdog(cfg: JobConfig) -> ckpt.HangWatchdog:
    store = default_store()
    t = cfg.train
    return ckpt.HangWatchdog(t.timeout_s, init_timeout_s=t.init_timeout_s, store=store, key="train.timeout_s")


def run_job(cfg: JobConfig) -> dict[str, Any]:
    """Run the job under torchrun (or as a single process); returns a summary on every rank.

    Returns:
        ``{"losses": [...] (steps run by this call), "start_step": int, "checkpoint": newest saved or None,
        "job": the trained Job (model, optimizer, meshes), "stopped": None, or when a signal stopped the run
        before its last step (preemption) {"signal", "step", "checkpoint"}, "val": [(step, val_loss), ...] of this
        call's evaluations}``.

    Raises:
        JobError: bad inputs, a diverged loss, a failed checkpoint save, another job in the output directory.
    """
    prep = prepare(cfg)
    tracking.check_available(cfg)  # an enabled tracker's package is installed (every rank alike)
    fault_plan = faults.Faults.from_env(prep.output_dir, prep.rank)  # the debug variable, read here only
    # From here SIGTERM / SIGUSR1 stop the run after a step, with a checkpoint of it, instead of ending the process.
    with StopOnSignal() as stop:
        device = init_distributed()
        with ckpt.OutputLock(prep.output_dir, device):  # one job per output directory: a second one stops here
            return _run(cfg, prep, device, stop, fault_plan)


def _build_and_resume(cfg: JobConfig, prep: Prepared, device: torch.device) -> tuple[Job, int]:
    """The built job and the steps it has taken (a resume loads its checkpoint)."""
    try:
        torch.manual_seed(cfg.train.seed)
        job = build(cfg, device, prep.model_config)  # resolved and checked once, by prepare's check_layout
        block = startup_block(
            cfg, job.model_config, job.meshes, prep.ranks_per_node, prep.data, device, prep.ckpt_dir, job.adapters
        )
        print0(block)
        print0(job.meshes.describe())
        start_step = 0
        if prep.resume_path is not None:
            start_step = resume_job(job, prep.resume_path)
            print0(f"resumed from {prep.resume_path} at step {start_step}")
            saved = ckpt.read_extra(prep.resume_path).get("config", {}).get("train", {})
            line = schedule_change(saved, cfg, start_step)  # a changed train.steps or schedule: say what the LR does
            if line:
                print0(line)
    except (ValueError, FileNotFoundError) as e:  # e.g. a weights file: each rank reads only its slices
        raise JobError(str(e), every_rank=False) from e  # printed once, by the first rank that reports it
    return job, start_step


def _run(
    cfg: JobConfig, prep: Prepared, device: torch.device, stop: StopOnSignal, fault_plan: faults.Faults
) -> dict[str, Any]:
    rank = dist.get_rank()
    if rank == 0:
        for path, why in prep.damaged:  # resume: auto skipped them for an older checkpoint that validates
            kept = ckpt.set_aside(path)
            print0(f"{why}; kept as {kept.name}, resuming from the newest checkpoint that validates instead")
        preemption.clear_marker(prep.output_dir)
    job, start_step = _build_and_resume(cfg, prep, device)
    if rank == 0:
        prep.output_dir.mkdir(parents=True, exist_ok=True)
        (prep.output_dir / "run.json").write_text(json.dumps(prep.identity, indent=1))
        (prep.output_dir / "config.yaml").write_text(_yaml(cfg))

    # The bar only on a terminal: in a log file its redraws would break up the per-step lines.
    bar = ProgressBar(cfg.train.steps, start_step) if rank == 0 and cfg.logging.progress_bar and _tty() else None
    console = (bar.write if bar else print0) if rank == 0 else None
    # The saves' writer_factory: the package's own writers unless a fault is due in a save.
    checkpointer = Checkpointer(job, prep.ckpt_dir, console=console, writer_factory=fault_plan.storage_writer)
    sinks = _open_trackers(cfg, prep.output_dir) if rank == 0 else ()
    metrics = MetricsLogger(
        job, prep.output_dir, enabled=rank == 0, start_step=start_step, console=bar and bar.write, sinks=sinks
    )
    profiler = None
    if cfg.logging.profile is not None:  # first in the list: it sees the whole step
        profiler = Profiler(cfg.logging.profile, prep.output_dir, rank, device, console=console)
    evaluator = None
    if prep.eval_batches is not None:  # after the metrics (their sinks are open, a step's record comes first)
        log = metrics.log if rank == 0 else None
        evaluator = Evaluator(job, prep.eval_batches, rank, log=log, start_step=start_step)
    totals = RunTotals()
    # Callbacks run in this order at each hook: the profiler around the whole step, the step's read of its stats and
    # the checks before its update first, the measurements before the metrics that log them, the checkpoint last.
    callbacks: list[Callback] = [
        *([profiler] if profiler else []),
        *([faults.FaultInjection(job.model, fault_plan)] if fault_plan else []),
        StopOnNonFinite(prep.ckpt_dir),
        # The clock restarts after a save or an evaluation: neither is a step's time.
        StepTimer(restart_after=lambda s: checkpointer.due(s) or (evaluator is not None and evaluator.due(s))),
        *([CommPerStep(job.meshes, prep.ranks_per_node)] if cfg.logging.comm_accounting else []),
        *([TokensPerSource(prep.batches.tokens_per_source, start_step)] if rank == 0 else []),
        totals,
        metrics,
        *([bar] if bar else []),
        *([evaluator] if evaluator else []),
        checkpointer,
    ]
    watchdog = _watchdog(cfg)
    callbacks.append(Heartbeat(watchdog))

    losses = LossLog()
    pin = device.type == "cuda"
    # Each data-parallel group's rows: the ranks of a sequence group read the same rows, each takes its shard.
    with (
        PrefetchLoader(prep.batches, job.meshes.dp_rank, start_step, cfg.train.steps, pin_memory=pin) as batches,
        watchdog,
    ):
        last = run(job, batches, [*callbacks, losses], start_step=start_step, stop_requested=stop.requested)
    stopped = None
    step = start_step + len(losses.losses)
    if last is not None and last.stop_agreed and step < cfg.train.steps:  # a preemption, saved by the checkpointer
        stopped = {"signal": stop.received or "a signal to another rank", "step": step}
        stopped["checkpoint"] = str(checkpointer.last_saved)
        if rank == 0:
            preemption.write_marker(prep.output_dir, stopped)
            print0(
                f"stopped by {stopped['signal']} after step {step}: checkpoint {checkpointer.last_saved} is "
                f"complete; exit status {preemption.EXIT_STATUS}, the same command resumes at step {step + 1}"
            )
    if job.adapters is not None and stopped is None:  # the trained adapter in PEFT's format, every rank gathering
        adapter = write_adapter(job, prep.output_dir / "adapter")
        if adapter is not None:
            print0(f"adapter {adapter} written (PEFT's format: PeftModel.from_pretrained(base model, folder))")
    print0(summary_line(start_step, step, totals, evaluator, checkpointer.last_saved, job.meshes.world_size))
    return {
        "losses": losses.losses,
        "start_step": start_step,
        "checkpoint": str(checkpointer.last_saved) if checkpointer.last_saved else None,
        "job": job,
        "stopped": stopped,
        "val": list(evaluator.history) if evaluator else [],
    }


def summary_line(
    start_step: int, step: int, totals: RunTotals, evaluator: Evaluator | None, checkpoint: Path | None, world: int
) -> str:
    """The run's last line: steps, predicted tokens, wall time, mean tokens/s/GPU, last and best validation loss,
    the newest checkpoint."""
    wall = time.strftime("%H:%M:%S", time.gmtime(time.perf_counter() - totals.started))
    parts = [
        f"done: steps {start_step + 1}-{step} ({totals.steps} in this run)" if totals.steps else f"done: step {step}",
        f"{totals.tokens:,} predicted tokens",
        f"wall {wall}",
        f"{totals.tokens_per_s_per_gpu(world):,.0f} tokens/s/GPU (predicted tokens over the steps' time)",
    ]
    if evaluator is not None and evaluator.last is not None:
        (last_step, last), best = evaluator.last, evaluator.best
        parts.append(f"val_loss {last:.4f} at step {last_step}")
        if best is not None and best != evaluator.last:
            parts.append(f"best {best[1]:.4f} at step {best[0]}")
    parts.append(f"checkpoint {checkpoint or 'none'}")
    return " | ".join(parts)


def _tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _open_trackers(cfg: JobConfig, output_dir: Path) -> tuple[Any, ...]:
    """Rank 0's W&B / MLflow runs (``moeshard.train.observe.tracking``); a tracker that fails to start is one line."""
    try:
        return tuple(tracking.open_sinks(cfg, output_dir))
    except Exception as e:  # noqa: BLE001 - the trackers raise their own types (network, credentials, store)
        raise JobError(
            f"experiment tracking (logging.wandb / logging.mlflow) could not start: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}",
            every_rank=False,
        ) from e


def _yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
