"""Running the job: the checks before it (:mod:`.prepare`), building it (:mod:`.build`), one step (:mod:`.step`),
the step loop (:mod:`.loop`); the whole run with its callbacks and resume is ``moeshard.train.job``, a layer above
(it composes this one with ``observe`` and ``checkpointer``, whose callbacks implement :class:`Callback`)."""

from moeshard.train.run.build import Job, build, init_distributed, lr_at, schedule_change
from moeshard.train.run.loop import Callback, LossLog, run
from moeshard.train.run.step import HostStats, StepStats, train_step

__all__ = [
    "Callback",
    "HostStats",
    "Job",
    "LossLog",
    "StepStats",
    "build",
    "init_distributed",
    "lr_at",
    "run",
    "schedule_change",
    "train_step",
]
