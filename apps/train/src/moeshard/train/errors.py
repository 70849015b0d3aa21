"""Errors the job reports as one clear line instead of a traceback.

A :class:`JobError` is raised the same way on every rank (a bad config, data or model, a diverged loss, a failed
save: each is either computed from the same inputs or agreed through a collective), so rank 0 alone prints it and
the process exits non-zero. Anything else is unexpected and keeps its traceback.
"""

from __future__ import annotations


class JobError(RuntimeError):
    """A problem with the job's inputs or state that every rank detects identically; the message says the fix."""


class TrainingDiverged(JobError):
    """A non-finite loss or gradient norm; the parameters were not updated and the last good checkpoint is kept."""


class CheckpointSaveError(JobError):
    """A checkpoint could not be written on some rank; nothing was published and the previous one is intact."""
