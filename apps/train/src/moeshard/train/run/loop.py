"""The step loop: :func:`run` over ``(step, micro_batches)`` with :class:`Callback` hooks (timing, fault injection,
communication accounting, metrics, the progress bar and checkpoints are callbacks, see ``moeshard.train.job``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from moeshard.data import Batch
from moeshard.train.run.build import Job
from moeshard.train.run.step import StepStats, train_step


class Callback:
    """Hooks of :func:`run`, called in list order; override the ones you need (each default does nothing).
    ``step`` counts from 1, as in metrics.jsonl, checkpoint names and messages."""

    def on_run_start(self) -> None:
        """Before the first step."""

    def on_step_start(self, step: int) -> None:
        """Before the step takes its batch and its forward runs."""

    def before_update(self, step: int, stats: StepStats) -> None:
        """After backward and clipping, before the optimizer step; raising leaves the parameters unchanged."""

    def on_step_end(self, step: int, stats: StepStats) -> None:
        """After the optimizer step was issued (the device may still be running it)."""

    def on_run_end(self) -> None:
        """After the last step, or when the run stops with an exception."""


def run(
    job: Job,
    batches: Iterable[tuple[int, Sequence[Batch]]],
    callbacks: Sequence[Callback] = (),
    *,
    start_step: int = 0,
    stop_requested: Callable[[], bool] | None = None,
) -> StepStats | None:
    """Train from ``start_step`` (steps already taken) to ``cfg.train.steps``, or until the ranks agree to stop;
    returns the last step's stats.

    Nothing is kept per step (a run may take millions): a callback records what it needs (e.g. :class:`LossLog`).

    Args:
        batches: ``(step, this rank's micro-batches)`` for steps ``start_step, start_step + 1, ...`` (0-based), in
            order: a ``moeshard.data.PrefetchLoader`` (prepared in the background), or any iterable, e.g.
            ``((s, step_batches.micro_batches(s, rank)) for s in range(start_step, steps))``.
        stop_requested: this rank's wish to stop (e.g. a signal arrived), asked before each step's all-reduce. When
            any rank wishes it, every rank ends the run after that same step (its callbacks see
            ``stats.stop_agreed``; a checkpoint callback saves it).

    Raises:
        ValueError: ``batches`` ran out, or gave another step than the loop's next.
    """

    def each(hook: str, *args: Any) -> None:
        for callback in callbacks:
            getattr(callback, hook)(*args)

    stats = None
    steps = iter(batches)
    each("on_run_start")
    try:
        for step in range(start_step, job.cfg.train.steps):
            done = step + 1  # steps count from 1 in callbacks, metrics, checkpoints and messages
            each("on_step_start", done)
            given, micro_batches = next(steps, (None, None))
            if given != step:
                raise ValueError(f"the batches gave step {given} where the loop takes step {step} (0-based)")
            stats = train_step(
                job,
                micro_batches,
                before_update=functools.partial(each, "before_update", done),
                stop_requested=stop_requested is not None and stop_requested(),
            )
            each("on_step_end", done, stats)
            if stop_requested is not None and stats.stop_agreed:
                break
    finally:
        each("on_run_end")
    return stats


class LossLog(Callback):
    """Keeps each step's global loss on the host (a float per step; the read is the step's one read, cached)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, step: int, stats: StepStats) -> None:  # noqa: D102
        self.losses.append(stats.read().loss)
