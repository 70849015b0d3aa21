"""The package's errors: one line each, naming the problem and the fix."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded, or the output directory is another job's.

    Args:
        every_rank: every rank raises it identically (the default: the outcome was agreed through a collective or
            computed from the same inputs); False for an error only some ranks may raise (a file one rank reads).
    """

    def __init__(self, message: str, *, every_rank: bool = True) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written on some rank (or there is no room for it); nothing was published and the
    previous checkpoint is intact."""
