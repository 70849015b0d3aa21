"""Validation during training: the held-out loss after every ``eval.every_steps`` steps, after the last step, and at
step 0 (before any update) with ``eval.at_start``.

The set is ``moeshard.data.EvalBatches`` over ``eval.path`` (``checks.prepare`` opens it with the training data's
``seq_len``, ``packing`` and ``tokenizer``): global batches of ``train.global_batch_size`` rows split over the
data-parallel ranks like training's (each rank of a sequence group its shard of the same rows), the last one filled with rows that predict nothing, so every rank runs the same forwards. The loss
is ``moeshard.models.common.evaluate``'s: the mean over every predicted token of all ranks, without gradients.
Rank 0 logs ``{"step", "val_loss", "val_ppl", "val_tokens", "eval_time_s"}`` to metrics.jsonl, TensorBoard and the
console. A step the ranks agreed to stop at (preemption) is not evaluated: its checkpoint comes first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from moeshard.data import EvalBatches
from moeshard.models.common import evaluate
from moeshard.train.run import Callback, Job, StepStats


class Evaluator(Callback):
    """Evaluates the job's model on ``batches`` when :meth:`due`; keeps ``(step, val_loss)`` of this run.

    Args:
        log: rank 0's sink of the record (``MetricsLogger.log``), None on the other ranks.
        start_step: steps already taken (a resumed run evaluates at step 0 only when it starts from scratch).
    """

    def __init__(
        self,
        job: Job,
        batches: EvalBatches,
        rank: int,
        *,
        log: Callable[[dict[str, Any]], None] | None,
        start_step: int = 0,
    ) -> None:
        self.job, self.batches, self.rank, self.log, self.start_step = job, batches, rank, log, start_step
        self.history: list[tuple[int, float]] = []

    def due(self, step: int) -> bool:
        """Whether the loop evaluates after ``step`` steps (0: before the first update)."""
        ev, steps = self.job.cfg.eval, self.job.cfg.train.steps
        if step == 0:
            return ev.at_start and self.start_step == 0
        return bool(ev.every_steps and step % ev.every_steps == 0) or step == steps

    def on_run_start(self) -> None:
        if self.due(0):
            self.evaluate(0)

    def on_step_end(self, step: int, stats: StepStats) -> None:
        if self.due(step) and not stats.stop_agreed:
            self.evaluate(step)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Evaluate now (collective: every rank calls it) and log the record on rank 0; returns it."""
        start = time.perf_counter()
        m = self.job.meshes  # under sequence parallelism the rows are the data-parallel group's, each rank its shard
        result = evaluate(
            self.job.model,
            self.batches.rank_batches(m.dp_rank),
            device=self.job.device,
            sp_rank=m.sp_rank,
            sp_size=m.sp_size,
        )
        record = {
            "step": step,
            "val_loss": result.loss,
            "val_ppl": result.ppl,
            "val_tokens": result.tokens,
            "eval_time_s": time.perf_counter() - start,
        }
        self.history.append((step, result.loss))
        if self.log is not None:
            self.log(record)
        return record

    @property
    def last(self) -> tuple[int, float] | None:
        """``(step, val_loss)`` of the newest evaluation of this run."""
        return self.history[-1] if self.history else None

    @property
    def best(self) -> tuple[int, float] | None:
        """``(step, val_loss)`` of the lowest finite loss of this run."""
        finite = [h for h in self.history if math.isfinite(h[1])]
        return min(finite, key=lambda h: h[1]) if finite else None
