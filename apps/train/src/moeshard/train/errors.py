"""Errors the job reports as one clear line instead of a traceback.

A :class:`JobError` is raised the same way on every rank by default (a bad config, data or model, a diverged loss,
a failed save: each is either computed from the same inputs or agreed through a collective), so rank 0 alone
prints it. One that only some ranks may raise (a file one rank reads, a load error of some ranks) says so with
``every_rank=False``: the first rank to report it prints it (``moeshard.train.__main__``). Anything else is
unexpected: one line too, and its traceback with ``MOESHARD_TRACEBACK=1``.

Exit statuses (:class:`moeshard.data.ExitStatus`, shared with ``python -m moeshard.data``): 2 for what the user can
fix (the default of a ``JobError``), 1 for a failure at run time (:class:`TrainingDiverged`, a failed save) or an
unexpected one.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

# Raised by moeshard.checkpoint (a RuntimeError of its own, with every_rank too) and reported like a JobError.
from moeshard.checkpoint import CheckpointError, CheckpointSaveError
from moeshard.data import ExitStatus

__all__ = [
    "ArgumentParser",
    "CheckpointError",
    "CheckpointSaveError",
    "JobError",
    "TrainingDiverged",
    "UsageError",
    "exit_status",
]


class JobError(RuntimeError):
    """A problem with the job's inputs or state; the message says the fix.

    Args:
        every_rank: every rank raises it identically (the default); False for an error some ranks only may raise.
    """

    exit_status = ExitStatus.USER_ERROR

    def __init__(self, message: str, *, every_rank: bool = True) -> None:
        super().__init__(message)
        self.every_rank = every_rank


class TrainingDiverged(JobError):
    """A non-finite loss or gradient norm; the parameters were not updated and the last good checkpoint is kept."""

    exit_status = ExitStatus.FAILED  # the inputs were fine when it started: a failure at run time


class UsageError(JobError):
    """A command's flags cannot be parsed: one line naming the flag and where the options are listed."""


def exit_status(error: BaseException) -> int:
    """The exit status of a reported error: a ``JobError``'s own; 1 for a checkpoint that could not be saved (the
    disk, not the input); 2 for any other ``CheckpointError`` (a folder or checkpoint the job cannot use)."""
    if isinstance(error, JobError):
        return error.exit_status
    if isinstance(error, CheckpointSaveError):
        return ExitStatus.FAILED
    return ExitStatus.USER_ERROR


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the job's commands: a usage error raises :class:`UsageError` (one line, every rank alike,
    exit status 2) instead of printing the usage text and exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise the usage error as a :class:`UsageError`."""
        command = self.prog.removeprefix("moeshard-train").strip()  # the prefix of the line names the program
        where = f"{command}: " if command else ""
        raise UsageError(f"{where}{message} (`{self.prog} --help` lists the options)")
