"""``logging.profile: {steps: [a, b], memory: false}``: a torch.profiler trace of steps a..b, on every rank.

    torchrun --nproc-per-node 8 -m moeshard.train --config FILE.yaml --logging.profile.steps=[10,11]

Each rank writes ``<output_dir>/profile/steps_A-B_rank_RRRRR.pt.trace.json.gz``: a Chrome trace of the host's ops
and (on CUDA) the kernels of those steps, checkpoint saves left out. Open it in https://ui.perfetto.dev (or
``chrome://tracing``), or ``tensorboard --logdir <output_dir>/profile`` with the torch-tb-profiler plugin. With
``memory: true`` on CUDA each rank also writes ``memory_steps_A-B_rank_RRRRR.pickle``, the allocator's history over
those steps: drop it on https://pytorch.org/memory_viz.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moeshard.train._torch_internals import dump_memory_snapshot, record_memory_history, stop_memory_history
from moeshard.train.config import ProfileConfig
from moeshard.train.run import Callback, StepStats


class Profiler(Callback):
    """Profiles steps ``first..last`` (counting from 1; put it first in the callback list so that it sees the
    whole step). Steps a resumed run already took are not profiled.

    Args:
        console: rank 0's line once the files are written (the progress bar's ``write``), else nothing.
    """

    def __init__(
        self,
        cfg: ProfileConfig,
        output_dir: Path,
        rank: int,
        device: torch.device,
        console: Callable[[str], None] | None = None,
    ) -> None:
        self.first, self.last = cfg.steps
        self.memory = cfg.memory and device.type == "cuda"
        self.device, self.console = device, console
        stem = f"steps_{self.first}-{self.last}_rank_{rank:05d}"
        self.trace = output_dir / "profile" / f"{stem}.pt.trace.json.gz"
        self.snapshot = output_dir / "profile" / f"memory_{stem}.pickle"
        self._prof: torch.profiler.profile | None = None
        if cfg.memory and device.type != "cuda" and console is not None:
            console("logging.profile.memory: a memory snapshot needs CUDA; this run writes the trace only")

    def on_step_start(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            record_memory_history(max_entries=1_000_000)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.start()

    def on_step_end(self, step: int, stats: StepStats) -> None:
        if step == self.last:
            self._finish()

    def on_run_end(self) -> None:
        self._finish()  # a run that stopped inside the range: what was recorded

    def _finish(self) -> None:
        if self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels, up to its optimizer step
        prof, self._prof = self._prof, None
        prof.stop()
        self.trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace))
        written = [self.trace.name]
        if self.memory:
            dump_memory_snapshot(str(self.snapshot))
            stop_memory_history()
            written.append(self.snapshot.name)
        if self.console is not None:
            self.console(
                f"profile of steps {self.first}-{self.last} written to {self.trace.parent}: {', '.join(written)}"
            )
