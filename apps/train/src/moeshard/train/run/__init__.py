"""Running the job: building it (:mod:`.build`), one step (:mod:`.step`), the step loop (:mod:`.loop`); the whole run
with its checks, data, callbacks and resume is :mod:`.job` (imported on its own: it composes everything else)."""

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
