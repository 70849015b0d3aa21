"""The steps ``moeshard-train bench`` times: synthetic or real micro-batches, the timed loop (back to back on CUDA
events, or isolated), the optional saves whose step-time cost it reports, and the profiled step."""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from moeshard.checkpoint import Stager, start_async_save
from moeshard.data import Batch, PrefetchLoader, StepBatches, open_dataset
from moeshard.data import DataConfig as Rows
from moeshard.train import checkpointer
from moeshard.train.run import train_step

if TYPE_CHECKING:
    from moeshard.train.observe.gpu_clock import ClockSampler
    from moeshard.train.run import Job, StepStats


def synthetic_batches(
    args: argparse.Namespace, mb: int, vocab: int, device: torch.device, g: torch.Generator
) -> list[Batch]:
    """One step's micro-batches of random tokens (pinned on CUDA, as a data loader hands them over): one causal
    sequence per row, or with ``--documents`` packed documents (document ids, positions restarting, no target at a
    document's first token)."""
    out = []
    s = args.seq_len
    for _ in range(args.batch_per_gpu // mb):
        ids = torch.randint(0, vocab, (mb, s), generator=g)
        rows = torch.arange(mb * s, dtype=torch.int32).view(mb, s) // s
        position_ids = document_ids = None
        labels = ids
        if args.documents:
            document_ids = torch.cat([_document_ids(s, args.documents, g)[None] for _ in range(mb)])
            starts = torch.ones_like(document_ids, dtype=torch.bool)
            starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
            index = torch.arange(s).expand(mb, s)
            position_ids = index - torch.where(starts, index, 0).cummax(1).values
            labels = ids.masked_fill(starts, -100)
        cu_seqlens = torch.arange(0, mb * s + 1, s, dtype=torch.int32)  # unused by the model (informative only)
        b = Batch(ids, labels, position_ids, document_ids, cu_seqlens, s, None, tuple(rows[:, 0].tolist()), ())
        out.append(b.pin_memory() if device.type == "cuda" else b)
    return out


def _document_ids(seq_len: int, mean: int, g: torch.Generator) -> torch.Tensor:
    """Document index of each position of one row cut from log-normal document lengths of mean ``mean``."""
    sigma = 1.4
    mu = torch.log(torch.tensor(float(mean))) - sigma**2 / 2
    lengths = (torch.randn(seq_len, generator=g) * sigma + mu).exp().ceil().long().clamp_min(1)
    ends = lengths.cumsum(0)
    n = int((ends < seq_len).sum()) + 1  # the last document is cut at the row's end
    sizes = torch.diff(ends[:n].clamp_max(seq_len), prepend=torch.zeros(1, dtype=torch.long))
    return torch.repeat_interleave(torch.arange(n, dtype=torch.int32), sizes)


def real_batches(args: argparse.Namespace, job: Job, world: int, mb: int):
    """The job's loader over ``--data`` for this rank, steps ``[0, --steps)``."""
    mc = job.model_config
    data = open_dataset(Rows(path=job.cfg.data.path, seq_len=args.seq_len), vocab_size=mc.vocab_size)
    batches = StepBatches(data, global_batch=args.batch_per_gpu * world, world_size=world, micro_batch=mb)
    return PrefetchLoader(batches, rank=dist.get_rank(), start_step=0, stop_step=args.steps)


def _mark() -> torch.cuda.Event:
    # An event on the compute stream, which the device passes once the previous step's work is done:
    # consecutive marks time each step as the device ran it in a training loop.
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class Saves:
    """``--checkpoint-every``: the job's checkpoint after every N-th step, as the training job saves it
    (``moeshard.checkpoint``, the job's staging buffers allocated once after the first, warm-up step), synchronously
    or in the background (``--checkpoint.async=true``). Each save's figures: the time it blocked the loop, the wait
    for the earlier save's write, its staging and write times and this rank's write rate."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        self.checkpointer, self.job, self.every = checkpointer, job, args.checkpoint_every
        self.dir = Path(args.checkpoint_dir)
        if dist.get_rank() == 0:  # bench's own folder (removed at the end): a crashed run's saves are no baseline
            shutil.rmtree(self.dir, ignore_errors=True)
        dist.barrier()
        self.pending = None
        self.group = dist.new_group(backend="gloo") if job.cfg.checkpoint.async_ else None
        self.stager = Stager(job.device)
        self.buffer_bytes, self.allocate_s = 0, 0.0
        self.records: list[dict] = []

    def before_update(self, stats: StepStats) -> None:
        if self.pending is not None:
            self.pending.wait_staged()  # as the job's Checkpointer: the optimizer step changes the staged state

    def _record(self, saved, wait_s: float) -> None:
        self.records.append(
            {
                "step": saved.step,
                "blocking_s": saved.blocking_s,
                "wait_for_previous_write_s": wait_s,
                "staging_s": saved.staging_s,
                "write_s": saved.write_s,
                "bytes_per_rank": saved.bytes,
                "write_gb_per_s_per_rank": saved.gb_per_s,
            }
        )

    def _finish_pending(self) -> float:
        """Wait for the background save in flight; returns the seconds waited."""
        if self.pending is None:
            return 0.0
        t0 = time.perf_counter()
        saved = self.pending.wait()
        wait_s = time.perf_counter() - t0
        self.records[-1].update(
            staging_s=saved.staging_s, write_s=saved.write_s, write_gb_per_s_per_rank=saved.gb_per_s
        )
        self.pending = None
        return wait_s

    def after_step(self, step: int) -> None:
        """``step`` counts from 1."""
        if step == 1 and self.job.device.type == "cuda":  # a warm-up step; the optimizer's state exists from here
            t0 = time.perf_counter()
            self.buffer_bytes = self.stager.allocate(self.checkpointer.app_state(self.job))
            self.allocate_s = time.perf_counter() - t0
        if self.pending is not None and dist.get_rank() == 0:
            self.pending.publish_if_done()
        if step % self.every:
            return
        wait_s = self._finish_pending()
        if self.group is None:  # the package's own writers, as a run without a fault plan
            saved = self.checkpointer.save_job(self.job, self.dir, step, None, self.stager)
        else:
            state = self.checkpointer.job_state(self.job, step)
            keep = self.job.cfg.checkpoint.keep_last
            self.pending = start_async_save(
                self.dir, step, *state, keep_last=keep, group=self.group, stager=self.stager
            )
            saved = self.pending.times()
        self._record(saved, wait_s)

    def finish(self) -> None:
        self._finish_pending()
        dist.barrier()
        self.stager.release()
        if dist.get_rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)


def save_cost(args: argparse.Namespace, times: list[float], saves: Saves) -> dict:
    """The step-time cost of one save: the step before it and the next one (where a background save's copy and
    write overlap) minus twice the median step outside such windows (``times``: the steps after warm-up); and
    each save's own figures (``saves``: blocking, wait for the earlier write, staging, write, GB/s)."""
    first = args.warmup  # times[j] is step first + j (0-based); a save follows 0-based step s when (s + 1) % N == 0
    before = [j for j in range(len(times) - 1) if (first + j + 1) % args.checkpoint_every == 0]
    windows = {j for b in before for j in (b, b + 1)}
    plain = [t for j, t in enumerate(times) if j not in windows]
    base = statistics.median(plain) if plain else float("nan")
    costs = [times[b] + times[b + 1] - 2 * base for b in before]
    return {
        "checkpoint_every": args.checkpoint_every,
        "async_checkpoint": args.async_checkpoint,
        "step_time_s_median_without_save": base,
        "save_cost_s": costs,
        "save_cost_s_median": statistics.median(costs) if costs else None,
        "saves": saves.records,
        "staging_buffers_bytes": saves.buffer_bytes,
        "staging_buffers_allocate_s": saves.allocate_s,
    }


def timed_steps(
    args: argparse.Namespace,
    job: Job,
    data: Iterable[list[Batch]],
    device: torch.device,
    back_to_back: bool,
    saves: Saves | None = None,
    clocks: ClockSampler | None = None,
) -> tuple[list[float], list[int], list[StepStats], list[float]]:
    """Run the ``--steps`` steps; return the times, device→host sync counts and host times of ``train_step`` (the
    host's own work where nothing waits for the device: a host time as long as the step means the host sets its
    pace) of the steps after warm-up, and every step's ``StepStats`` (not yet read).

    Back to back: CUDA events at consecutive step starts, one synchronisation after the last step. Otherwise
    (``--isolated-steps``, or on CPU): synchronise and barrier before each step, synchronise after it, host clock.
    ``clocks`` samples the GPU's clock and power over the steps after warm-up.
    A save of ``saves`` after a step counts in that step's time.
    """

    def before_update(stats: StepStats) -> None:
        if args.check_finite:
            stats.read()  # as moeshard-train's loop: the update waits for finite figures
        if saves is not None:
            saves.before_update(stats)

    times, syncs, step_stats, marks, host = [], [], [], [], []
    if back_to_back:
        torch.cuda.synchronize()
        dist.barrier()
    try:
        for step, micro in zip(range(args.steps), data):
            if not back_to_back:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
            count = step >= args.warmup and device.type == "cuda"
            if step == args.warmup and clocks is not None:
                clocks.start()  # the timed steps' clock and power only
            caught: list[tuple[str, list[str]]] = []
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                # Keep each sync warning's Python stack: the warning's own location is often inside torch.
                warnings.showwarning = lambda msg, *a, _c=caught, **k: _c.append(
                    (str(msg), traceback.format_stack(limit=12))
                )
                if count:
                    torch.cuda.set_sync_debug_mode("warn")
                if back_to_back:
                    marks.append(_mark())
                t0 = time.perf_counter()
                stats = train_step(job, micro, before_update=before_update)
                host.append(time.perf_counter() - t0)
                if count:
                    torch.cuda.set_sync_debug_mode("default")
                if saves is not None:
                    saves.after_step(step + 1)
                if not back_to_back:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
            step_stats.append(stats)
            if step >= args.warmup:
                found = [stack for msg, stack in caught if "synchroniz" in msg]
                syncs.append(len(found))
                if step == args.warmup and dist.get_rank() == 0:
                    _print_sync_sites(found)
        if back_to_back:
            marks.append(_mark())
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
    finally:
        if clocks is not None:
            clocks.stop()  # the timed steps' samples only; also where a step raised
    return times[args.warmup :], syncs, step_stats, host[args.warmup :]


def _print_sync_sites(found: list[list[str]]) -> None:
    """Where the first timed step synchronised, one line per sync warning's Python stack."""
    for stack in found:
        # innermost project (or optimizer) frames first, the benchmark's own frames left out
        frames = [f.strip().splitlines()[0] for f in stack if "bench.py" not in f]
        where = [f for f in frames if "moeshard" in f or "torch/optim" in f]
        print("sync at", " <- ".join(reversed(where[-3:])))


def profile_step(args: argparse.Namespace, job: Job, batches: Callable[[], list[Batch]]) -> None:
    """Profile ``--trace-steps`` steps (bench runs it on CUDA) after ``--trace-warmup`` more, all back to back as the
    timed ones (one synchronisation, after the last); rank 0 writes ``--trace`` and ``--profile`` and prints the
    kernel table.

    The first step after the timed loop starts from an empty launch queue (the loop synchronised at its end): its
    first forward has none of the lead that the previous step's optimizer gives a back-to-back step, so where the
    host is near the device's pace it idles where a training loop's steps do not. The warm-up steps run under the
    profiler's warm-up phase (``torch.profiler.schedule``), which records nothing: with one or more, the trace holds
    steady steps only."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    if args.trace_gpu_only:
        activities = [ProfilerActivity.CUDA]
    warm, active = args.trace_warmup, args.trace_steps
    micro = [batches() for _ in range(warm + active)]  # made first, as the timed loop's
    plan = schedule(wait=0, warmup=warm, active=active, repeat=1) if warm else None
    with profile(activities=activities, schedule=plan) as prof:
        for i, m in enumerate(micro):
            train_step(job, m)
            if i == len(micro) - 1 and torch.cuda.is_available():
                torch.cuda.synchronize()  # the last traced step's kernels, before the profiler stops
            if warm:
                prof.step()
    if dist.get_rank() == 0 and args.trace:
        prof.export_chrome_trace(args.trace)
    if dist.get_rank() == 0 and args.profile:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
        with open(args.profile, "w") as f:
            f.write(table)
        print(table)
