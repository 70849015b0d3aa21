"""Errors the job reports as one clear line instead of a traceback.

A :class:`JobError` is raised the same way on every rank by default (a bad config, data or model, a diverged loss,
a failed save: each is either computed from the same inputs or agreed through a collective), so rank 0 alone
prints it. One that only some ranks may raise (a file one rank reads, a load error of some ranks) says so with
``every_rank=False``: the first rank to report it prints it (``moeshard.train.__main__``). Anything else is
unexpected: one line too, and its traceback with ``MOESHARD_TRACEBACK=1``.
"""

from __future__ import annotations

# Raised by moeshard.checkpoint (a RuntimeError of its own, with every_rank too) and reported like a JobError.
from moeshard.checkpoint import CheckpointError, CheckpointSaveError

__all__ = ["CheckpointError", "CheckpointSaveError", "JobError", "TrainingDiverged"]


class JobError(RuntimeError):
    """A problem with the job's inputs or state; the message says the fix.

    Args:
        every_rank: every rank raises it identically (the default); False for an error some ranks only may raise.
    """

    def __init__(self, message: str, *, every_rank: bool = True) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class TrainingDiverged(JobError):
    """A non-finite loss or gradient norm; the parameters were not updated and the last good checkpoint is kept."""
