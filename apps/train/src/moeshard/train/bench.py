"""``moeshard-train bench``: throughput of the full training step on the Qwen3-30B-A3B geometry with L layers.

    torchrun --nproc-per-node 2 -m moeshard.train bench --parallel.ep_size=2 --out bench.json
    torchrun --nproc-per-node 1 -m moeshard.train bench --parallel.compile=true --parallel.ep.kernels=triton
    torchrun --nproc-per-node 1 -m moeshard.train bench --config my_job.yaml --model.overrides.num_hidden_layers=4

The job is the training job's (``--config FILE --section.key=value``, as ``moeshard-train`` takes them) over the
benchmark's own (``BENCH_JOB``: 8 layers of the 30B-A3B geometry, EP 1, synthetic tokens, seq 4096), 4 sequences
per GPU per step by default, bf16 compute with fp32 master weights and fp32 gradient reduction, AdamW, clipping;
only what is the benchmark's own is a flag of its own (steps, warm-up, batch per GPU, timing, synthetic
documents, checkpoint cost, profile and trace). Prints and writes (JSON) tokens/s/GPU (median of the steps after
warm-up), MFU, peak memory, device→host syncs per step (``torch.cuda.set_sync_debug_mode``), the layout and the
options. It builds and steps through ``moeshard.train.train`` (``build``, ``train_step``) like the training job.
FLOPs/token: the model family's ``flops_per_token`` (6·matmul params active per token + causal attention; MLA counted from
its projections); MFU over 989 TFLOP/s. ``--model.family=deepseek_v3 --model.preset=deepseek-v3-16b`` benchmarks DeepSeek-V3.

Steps run back to back, as a training loop runs them (no synchronisation between steps; the losses are read
after the last one) and each step's time is the device's, from CUDA events recorded at consecutive step starts:
the host prepares a step while the device still runs the previous one. ``--isolated-steps`` times every step
alone instead (synchronise and barrier before it, synchronise after it, host clock), so each step also pays
the host's start-up latency before its first kernel.

``--checkpoint-every N`` saves the job's checkpoint (model, optimizer: what training saves) after every N-th step
into ``--checkpoint-dir`` (removed at the end), synchronously or with ``--checkpoint.async=true`` as the job
does, and reports the step-time cost of one save: the time of the step before the save
and the next one (where a background save's copy and write overlap) minus twice the median step without a save.

    torchrun --nproc-per-node 1 -m moeshard.train bench --steps 24 --checkpoint-every 6
    torchrun --nproc-per-node 1 -m moeshard.train bench --steps 24 --checkpoint-every 6 --checkpoint.async=true
"""

from __future__ import annotations

import argparse
import json
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

from moeshard.data import Batch
from moeshard.train.config import JobConfig, load_config
from moeshard.train.metrics import flops_per_token, mfu

if TYPE_CHECKING:
    from moeshard.train.train import Job, StepStats


def main(argv: list[str]) -> int:
    """Run the benchmark under torchrun; rank 0 prints the table and writes ``--out``."""
    args, overrides = _parse_args(argv)

    from moeshard.train.train import build, init_distributed

    device = init_distributed()
    world = dist.get_world_size()
    cfg = _job_config(args, overrides, world)
    mb = cfg.train.micro_batch_size
    # The job's figures the benchmark's helpers read.
    args.seq_len, args.ep_size, args.data = cfg.data.seq_len, cfg.parallel.ep_size, cfg.data.path
    args.async_checkpoint = cfg.checkpoint.async_
    torch.manual_seed(0)
    job = build(cfg, device)
    if dist.get_rank() == 0:
        print("\n".join(job.parallel.options.describe()))
    g = torch.Generator().manual_seed(1234 + dist.get_rank())

    def batches() -> list[Batch]:
        return _synthetic_batches(args, mb, job.model_config.vocab_size, device, g)

    back_to_back = not args.isolated_steps and device.type == "cuda"
    saves = _Saves(args, job) if args.checkpoint_every else None
    if args.data and args.preload:
        with _real_batches(args, job, world, mb) as loader:
            data = [micro for _, micro in loader]  # the same rows, all made before the timed loop
        times, syncs, step_stats = _timed_steps(args, job, data, device, back_to_back, saves)
    elif args.data:
        # Real rows through the training job's loader: prepared in a background thread while the steps run.
        with _real_batches(args, job, world, mb) as loader:
            times, syncs, step_stats = _timed_steps(
                args, job, (micro for _, micro in loader), device, back_to_back, saves
            )
    else:
        # Made before the timed loop (a training loop's data loader prepares them in the background).
        data = [batches() for _ in range(args.steps)]
        times, syncs, step_stats = _timed_steps(args, job, data, device, back_to_back, saves)
    if saves is not None:
        saves.finish()
    losses = [stats.read().loss for stats in step_stats]  # read after the timed steps
    if (args.profile or args.trace) and device.type == "cuda":
        _profile_step(args, job, batches)
    result = _result(args, job, device, world, mb, back_to_back, times, syncs, losses)
    if saves is not None:
        result.update(_save_cost(args, times))
    if dist.get_rank() == 0:
        _report(result, args.out, isolated=not back_to_back)
    dist.barrier()
    dist.destroy_process_group()
    return 0


BENCH_JOB: dict[str, dict] = {
    "model": {"preset": "qwen3-30b-a3b", "overrides": {"num_hidden_layers": 8}},
    "parallel": {"ep_size": 1},
    "data": {"seq_len": 4096},
    "train": {"lr": 1e-4, "warmup_steps": 1, "min_lr": 1e-5},
    "checkpoint": {"resume": "none"},
    "logging": {"tensorboard": False, "progress_bar": False},
}
"""The benchmark's job under ``--config`` and the ``--section.key=value`` overrides: 8 layers of the 30B-A3B
geometry, EP 1, seq 4096, synthetic rows (``--data.path=...`` for real ones), the compute dtype ``auto`` (bf16 on
CUDA)."""

# The flags of 0.3 that are the job's keys now: one line says what to write instead.
RENAMED_FLAGS = {
    "--preset": "--model.preset=NAME",
    "--layers": "--model.overrides.num_hidden_layers=N",
    "--seq-len": "--data.seq_len=N",
    "--micro-batch": "--train.micro_batch_size=N",
    "--ep-size": "--parallel.ep_size=N",
    "--prefetch-depth": "--parallel.prefetch_depth=N",
    "--no-prefetch-at-host-sync": "--parallel.prefetch_at_host_sync=false",
    "--activation-checkpointing": "--parallel.activation_checkpointing=full|selective",
    "--selective-recompute": "--parallel.selective_recompute=mlp|activation",
    "--no-reshard-after-forward": "--parallel.reshard_after_forward=false",
    "--expert-reshard-after-forward": "--parallel.expert_reshard_after_forward=true",
    "--no-expert-reshard-after-forward": "--parallel.expert_reshard_after_forward=false",
    "--expert-reduce-dtype": "--parallel.expert_reduce_dtype=bfloat16",
    "--compile": "--parallel.compile=true --parallel.ep.kernels=triton",
    "--no-fused-expert-update": "--train.fuse_local_experts=false",
    "--gradient-sync": "--train.gradient_sync=last_micro_batch",
    "--dispatch": "--parallel.ep.dispatch=overlapped|all_to_all",
    "--expert-kernels": "--parallel.ep.kernels=eager|compiled|triton",
    "--sm-carveout": "--parallel.ep.sm_carveout=N",
    "--data": "--data.path=PATH",
    "--async-checkpoint": "--checkpoint.async=true",
}


def _parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line of ``moeshard-train bench``: the job's ``--config FILE --section.key=value``, plus the
    benchmark's own flags (steps, warm-up, batch per GPU, timing, synthetic documents, checkpoint cost, profile)."""
    p = argparse.ArgumentParser(
        prog="moeshard-train bench",
        epilog="Any --section.key=value sets a key of the job (as moeshard-train does), over --config and over the "
        "benchmark's job (8 layers of qwen3-30b-a3b, EP 1, seq 4096, synthetic rows).",
    )
    p.add_argument("--config", default=None, help="a job's YAML file (its keys over the benchmark's job)")
    p.add_argument("--steps", type=int, default=12, help="steps in all (train.steps), warm-up included")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the timing")
    p.add_argument(
        "--batch-per-gpu", type=int, default=4, help="sequences per GPU per step (train.global_batch_size / world)"
    )
    p.add_argument(
        "--isolated-steps",
        action="store_true",
        help="time each step alone: synchronise and barrier before it, synchronise after it, host clock (includes "
        "the host's start-up latency of every step); default: steps run back to back as in a training loop, each "
        "timed on the device by CUDA events at consecutive step starts",
    )
    p.add_argument(
        "--check-finite",
        action="store_true",
        help="read each step's loss and grad norm before its optimizer step, as moeshard-train's loop does (it "
        "updates only after finding them finite): one more device-to-host sync per step",
    )
    p.add_argument(
        "--documents",
        type=int,
        default=0,
        metavar="MEAN",
        help="synthetic packed rows of documents with long-tailed (log-normal, sigma 1.4) lengths of mean MEAN "
        "tokens, document-masked attention and positions restarting per document (0: one causal sequence per row)",
    )
    p.add_argument(
        "--preload",
        action="store_true",
        help="with --data.path: read every step's rows before the timed loop (the loader's cost left out)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="save the job's checkpoint after every N-th step and report the step-time cost of a save (0: none); "
        "--checkpoint.async=true saves in the background",
    )
    p.add_argument(
        "--checkpoint-dir", default="bench_checkpoints", help="where --checkpoint-every saves (removed at the end)"
    )
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="write the torch.profiler kernel table of one step here")
    p.add_argument("--trace", default=None, help="write rank 0's Chrome trace of the profiled step here (.json.gz)")
    p.add_argument(
        "--trace-gpu-only",
        action="store_true",
        help="profile GPU activity only: no host-side op records, so the host runs at nearly its unprofiled speed "
        "and host-bound stretches show as they are",
    )
    args, rest = p.parse_known_args(argv)
    overrides = []
    for item in rest:
        flag = item.split("=", 1)[0]
        if flag in RENAMED_FLAGS:
            p.error(f"{flag} is a key of the job now: write {RENAMED_FLAGS[flag]}")
        if not (item.startswith("--") and "." in flag and "=" in item):
            p.error(f"unrecognized argument {item!r} (the job's keys are --section.key=value)")
        overrides.append(item)
    return args, overrides


def _job_config(args: argparse.Namespace, overrides: list[str], world: int) -> JobConfig:
    """The training job's config for the benchmark: :data:`BENCH_JOB` under ``--config`` and the overrides, with
    the benchmark's steps and batch (micro-batch: the batch per GPU unless ``train.micro_batch_size`` is given)."""
    train = {"steps": args.steps, "global_batch_size": args.batch_per_gpu * world}
    if not any(o.startswith("--train.micro_batch_size=") for o in overrides):
        train["micro_batch_size"] = args.batch_per_gpu
    base = {**BENCH_JOB, "train": {**BENCH_JOB["train"], **train}}
    return load_config(args.config, overrides, base=base)


def _synthetic_batches(
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


def _real_batches(args: argparse.Namespace, job: Job, world: int, mb: int):
    """The job's loader over ``--data`` for this rank, steps ``[0, --steps)``."""
    from moeshard.data import DataConfig as Rows
    from moeshard.data import PrefetchLoader, StepBatches, open_dataset

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


class _Saves:
    """``--checkpoint-every``: the job's checkpoint after every N-th step, as the training job saves it
    (``moeshard.train.checkpoint``), synchronously or in the background (``--async-checkpoint``)."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        from moeshard.train import checkpoint as ckpt
        from moeshard.train import checkpoint_async

        self.ckpt, self.job, self.every = ckpt, job, args.checkpoint_every
        self.start_async_save, self.make_stager = checkpoint_async.start_async_save, checkpoint_async.make_stager
        self.dir = Path(args.checkpoint_dir)
        self.pending = None
        self.group = dist.new_group(backend="gloo") if job.cfg.checkpoint.async_ else None

    def before_update(self, stats: StepStats) -> None:
        if self.pending is not None:
            self.pending.wait_staged()  # as the job's Checkpointer: the optimizer step changes the staged state

    def after_step(self, step: int) -> None:
        """``step`` counts from 1."""
        if self.pending is not None and dist.get_rank() == 0:
            self.pending.publish_if_done()
        if step % self.every:
            return
        keep = self.job.cfg.checkpoint.keep_last
        if self.pending is not None:
            self.pending.wait()
        if self.group is None:
            self.ckpt.save_job(self.job, self.dir, step)
        else:
            state = self.ckpt.job_state(self.job, step)
            self.pending = self.start_async_save(
                self.dir, step, *state, keep_last=keep, group=self.group, stager=self.make_stager(self.job.device)
            )  # a stager per save, as the job's Checkpointer

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)


def _save_cost(args: argparse.Namespace, times: list[float]) -> dict:
    """The step-time cost of one save: the step before it and the next one (where a background save's copy and
    write overlap) minus twice the median step outside such windows (``times``: the steps after warm-up)."""
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
    }


def _timed_steps(
    args: argparse.Namespace,
    job: Job,
    data: Iterable[list[Batch]],
    device: torch.device,
    back_to_back: bool,
    saves: _Saves | None = None,
) -> tuple[list[float], list[int], list[StepStats]]:
    """Run the ``--steps`` steps; return the times and device→host sync counts of the steps after warm-up and
    every step's ``StepStats`` (not yet read).

    Back to back: CUDA events at consecutive step starts, one synchronisation after the last step. Otherwise
    (``--isolated-steps``, or on CPU): synchronise and barrier before each step, synchronise after it, host clock.
    A save of ``saves`` after a step counts in that step's time.
    """
    from moeshard.train.train import train_step

    def before_update(stats: StepStats) -> None:
        if args.check_finite:
            stats.read()  # as moeshard-train's loop: the update waits for finite figures
        if saves is not None:
            saves.before_update(stats)

    times, syncs, step_stats, marks = [], [], [], []
    if back_to_back:
        torch.cuda.synchronize()
        dist.barrier()
    for step, micro in zip(range(args.steps), data):
        if not back_to_back:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
        count = step >= args.warmup and device.type == "cuda"
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
    return times[args.warmup :], syncs, step_stats


def _print_sync_sites(found: list[list[str]]) -> None:
    """Where the first timed step synchronised, one line per sync warning's Python stack."""
    for stack in found:
        # innermost project (or optimizer) frames first, the benchmark's own frames left out
        frames = [f.strip().splitlines()[0] for f in stack if "bench.py" not in f]
        where = [f for f in frames if "moeshard" in f or "torch/optim" in f]
        print("sync at", " <- ".join(reversed(where[-3:])))


def _profile_step(args: argparse.Namespace, job: Job, batches: Callable[[], list[Batch]]) -> None:
    """Profile one more step (CUDA only); rank 0 writes ``--trace`` and ``--profile`` and prints the kernel table."""
    from torch.profiler import ProfilerActivity, profile

    from moeshard.train.train import train_step

    activities = [ProfilerActivity.CUDA] if args.trace_gpu_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof:
        train_step(job, batches())
        torch.cuda.synchronize()
    if dist.get_rank() == 0 and args.trace:
        prof.export_chrome_trace(args.trace)
    if dist.get_rank() == 0 and args.profile:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
        with open(args.profile, "w") as f:
            f.write(table)
        print(table)


def _result(
    args: argparse.Namespace,
    job: Job,
    device: torch.device,
    world: int,
    mb: int,
    back_to_back: bool,
    times: list[float],
    syncs: list[int],
    losses: list[float],
) -> dict:
    """The figures ``--out`` holds (benchmarks/table.sh and benchmarks/compare.sh read these keys)."""
    step_s = statistics.median(times)
    tps = args.batch_per_gpu * args.seq_len / step_s
    fpt = flops_per_token(job.model_config, args.seq_len)
    cfg, options = job.cfg, job.parallel.options
    layers = job.model_config.num_hidden_layers
    return {
        "layers": layers,
        "seq_len": args.seq_len,
        "world_size": world,
        "ep_size": args.ep_size,
        "ep_fsdp_size": world // args.ep_size,
        "batch_per_gpu": args.batch_per_gpu,
        "micro_batch": mb,
        "activation_checkpointing": options.activation_checkpointing,
        "selective_recompute": options.selective_recompute if options.activation_checkpointing == "selective" else None,
        "prefetch_depth": options.prefetch_depth,
        "prefetch_at_host_sync": options.prefetch_at_host_sync,
        "reshard_after_forward": options.reshard_after_forward,
        "expert_reshard_after_forward": options.expert_reshard_after_forward,
        "expert_reduce_dtype": options.expert_reduce_dtype,
        "compile": options.compile,
        "fused_expert_update": cfg.train.fuse_local_experts,
        "gradient_sync": cfg.train.gradient_sync,
        "dispatch": options.ep.dispatch,
        "expert_kernels": options.ep.kernels,
        "sm_carveout": options.ep.sm_carveout,
        "check_finite": args.check_finite,
        "documents_mean_len": args.documents or None,
        "data": args.data,
        "preload": args.preload,
        "timing": "isolated steps (host clock)" if not back_to_back else "back to back (CUDA events)",
        "step_time_s_median": step_s,
        "step_times_s": times,
        "tokens_per_s_per_gpu": tps,
        "flops_per_token": fpt,
        "mfu": mfu(tps, fpt),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None,
        "syncs_per_step": statistics.median(syncs) if syncs else None,
        "moe_layers": layers,
        "losses": losses,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }


def _report(result: dict, out: str | None, isolated: bool) -> None:
    """Print the one-line summary (the benchmark scripts show it) and write ``result`` to ``out`` as JSON."""
    r = result
    times = r["step_times_s"]
    print(
        f"layers {r['layers']} seq {r['seq_len']} | world {r['world_size']} = ep {r['ep_size']} x ep_fsdp {r['ep_fsdp_size']} "
        f"| {r['batch_per_gpu']} seq/GPU (micro {r['micro_batch']}) | step {1000 * r['step_time_s_median']:.1f} ms{' isolated' if isolated else ''} "
        f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f}) | {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU | "
        f"MFU {100 * r['mfu']:.1f}% | peak alloc {r['peak_allocated_gib'] or 0:.1f} GiB "
        f"reserved {r['peak_reserved_gib'] or 0:.1f} GiB | syncs/step {r['syncs_per_step']}"
    )
    if "save_cost_s_median" in r:
        cost = r["save_cost_s_median"]
        print(
            f"checkpoint every {r['checkpoint_every']} steps ({'async' if r['async_checkpoint'] else 'sync'}): "
            f"step {1000 * r['step_time_s_median_without_save']:.1f} ms without a save, a save costs "
            + (f"{cost:.2f} s of step time" if cost is not None else "? (no save after warm-up)")
        )
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
