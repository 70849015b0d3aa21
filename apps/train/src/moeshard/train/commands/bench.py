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
options. It builds and steps through ``moeshard.train.run`` (``build``, ``train_step``) like the training job.
FLOPs/token: the model family's ``flops_per_token`` (6·matmul params active per token + causal attention; MLA
counted from its projections); MFU against the H200's bf16 dense peak whatever the device
(``observe.metrics.H200_BF16_PEAK_FLOPS``), so figures of different runs compare. ``--model.family=deepseek_v3 --model.preset=deepseek-v3-16b``
benchmarks DeepSeek-V3.

Steps run back to back, as a training loop runs them (no synchronisation between steps; the losses are read
after the last one) and each step's time is the device's, from CUDA events recorded at consecutive step starts:
the host prepares a step while the device still runs the previous one. Back to back it also reports the host's
own time in ``train_step`` (median; without ``--check-finite``, whose read waits for the device): as long as the
step, the host sets the pace; well under it, the device does. ``--isolated-steps`` times every step
alone instead (synchronise and barrier before it, synchronise after it, host clock), so each step also pays
the host's start-up latency before its first kernel.

``--checkpoint-every N`` saves the job's checkpoint (model, optimizer: what training saves) after every N-th step
into ``--checkpoint-dir`` (removed at the end), synchronously or with ``--checkpoint.async=true`` as the job
does, and reports the step-time cost of one save: the time of the step before the save
and the next one (where a background save's copy and write overlap) minus twice the median step without a save;
and per save the time it blocked the loop, the wait for the earlier save's write, its staging and write times and
the write rate per rank (GB/s).

    torchrun --nproc-per-node 1 -m moeshard.train bench --steps 24 --checkpoint-every 6
    torchrun --nproc-per-node 1 -m moeshard.train bench --steps 24 --checkpoint-every 6 --checkpoint.async=true
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeshard.data import Batch
from moeshard.train.commands.bench_steps import (
    Saves,
    profile_step,
    real_batches,
    save_cost,
    synthetic_batches,
    timed_steps,
)
from moeshard.train.config import JobConfig, check_layout, gradient_sync, load_config
from moeshard.train.errors import ArgumentParser
from moeshard.train.observe.gpu_clock import ClockSampler
from moeshard.train.observe.metrics import flops_per_token, mfu
from moeshard.train.run import build, init_distributed

if TYPE_CHECKING:
    from moeshard.train.run import Job


def main(argv: list[str]) -> int:
    """Run the benchmark under torchrun; rank 0 prints the table and writes ``--out``."""
    args, overrides = _parse_args(argv)
    device = init_distributed()
    world = dist.get_world_size()
    cfg = _job_config(args, overrides, world)
    mb = cfg.train.micro_batch_size
    # The job's figures the benchmark's helpers read.
    args.seq_len, args.ep_size, args.data = cfg.data.seq_len, cfg.parallel.ep_size, cfg.data.path
    args.async_checkpoint = cfg.checkpoint.async_
    torch.manual_seed(0)
    # The checks training makes before it builds; the model config they resolve is the one built.
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    job = build(cfg, device, check_layout(cfg, world_size=world, ranks_per_node=per_node).model_config)
    if dist.get_rank() == 0:
        print("\n".join(job.parallel.options.describe()))
    g = torch.Generator().manual_seed(1234 + dist.get_rank())

    def batches() -> list[Batch]:
        return synthetic_batches(args, mb, job.model_config.vocab_size, device, g)

    back_to_back = not args.isolated_steps and device.type == "cuda"
    saves = Saves(args, job) if args.checkpoint_every else None
    clocks = ClockSampler(device)  # started and stopped by timed_steps around the timed steps
    if args.data and args.preload:
        with real_batches(args, job, world, mb) as loader:
            data = [micro for _, micro in loader]  # the same rows, all made before the timed loop
        times, syncs, step_stats, host = timed_steps(args, job, data, device, back_to_back, saves, clocks)
    elif args.data:
        # Real rows through the training job's loader: prepared in a background thread while the steps run.
        with real_batches(args, job, world, mb) as loader:
            times, syncs, step_stats, host = timed_steps(
                args, job, (micro for _, micro in loader), device, back_to_back, saves, clocks
            )
    else:
        # Made before the timed loop (a training loop's data loader prepares them in the background).
        data = [batches() for _ in range(args.steps)]
        times, syncs, step_stats, host = timed_steps(args, job, data, device, back_to_back, saves, clocks)
    if saves is not None:
        saves.finish()
    losses = [stats.read().loss for stats in step_stats]  # read after the timed steps
    if (args.profile or args.trace) and device.type == "cuda":
        profile_step(args, job, batches)
    result = _result(args, job, device, world, mb, back_to_back, times, syncs, losses, host)
    result.update(clocks.summary(step_s=result["step_time_s_median"]))
    if saves is not None:
        result.update(save_cost(args, times, saves))
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
    p = ArgumentParser(
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
    p.add_argument("--profile", default=None, help="write the torch.profiler kernel table of the profiled steps here")
    p.add_argument("--trace", default=None, help="write rank 0's Chrome trace of the profiled steps here (.json.gz)")
    p.add_argument(
        "--trace-steps",
        type=int,
        default=1,
        metavar="N",
        help="profile N steps back to back (default 1), after --trace-warmup steps that the trace leaves out",
    )
    p.add_argument(
        "--trace-warmup",
        type=int,
        default=1,
        metavar="N",
        help="run N steps under the profiler's warm-up phase (recorded by nothing) before the traced ones, back to "
        "back with them: the first step after the timed loop starts from an empty launch queue, so with N >= 1 the "
        "trace holds steady steps only (default 1; 0: trace that first step too)",
    )
    p.add_argument(
        "--trace-gpu-only",
        action="store_true",
        help="profile GPU activity only: no host-side op records, so the host runs at nearly its unprofiled speed "
        "and host-bound stretches show as they are",
    )
    args, rest = p.parse_known_args(argv)
    if args.trace_steps < 1:
        p.error(f"--trace-steps must be at least 1, got {args.trace_steps}")
    if args.trace_warmup < 0:
        p.error(f"--trace-warmup must be at least 0, got {args.trace_warmup}")
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
    host: list[float],
) -> dict:
    """The figures ``--out`` holds (benchmarks/table.sh and benchmarks/compare.sh read these keys)."""
    step_s = statistics.median(times)
    tps = args.batch_per_gpu * args.seq_len / step_s
    fpt = flops_per_token(job.model_config, args.seq_len)
    cfg, options = job.cfg, job.parallel.options
    layers = job.model_config.num_hidden_layers
    reshard, expert_reshard = options.resharding(world)  # as parallelize resolved them
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
        "reshard_after_forward": reshard,
        "expert_reshard_after_forward": expert_reshard,
        "expert_reduce_dtype": options.expert_reduce_dtype,
        "compile": options.compile,
        "fused_expert_update": cfg.train.fuse_local_experts,
        "gradient_sync": gradient_sync(cfg.train, world),
        "expert_weight_grads": cfg.train.expert_weight_grads,
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
        # train_step's own host time (back to back: nothing in it waits for the device; ~ the step: host-paced)
        "host_time_s_median": statistics.median(host) if host and back_to_back and not args.check_finite else None,
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
        + (f" | host {1000 * r['host_time_s_median']:.1f} ms" if r.get("host_time_s_median") is not None else "")
    )
    if "gpu_sm_clock_mhz_mean" in r:  # whether the power limit paced the timed steps (observe.gpu_clock)
        print(
            f"SM clock {r['gpu_sm_clock_mhz_mean']:.0f} MHz (min {r['gpu_sm_clock_mhz_min']:.0f}, max "
            f"{r['gpu_sm_clock_mhz_max_possible']:.0f}) | {r['gpu_power_w_mean']:.0f} W of {r['gpu_power_limit_w']:.0f}, "
            f"power-capped in {100 * r['gpu_power_capped_share']:.0f}% of samples | ~{r['gpu_energy_j_per_step']:.0f} J "
            "per step"
        )
    if "save_cost_s_median" in r:
        cost = r["save_cost_s_median"]
        print(
            f"checkpoint every {r['checkpoint_every']} steps ({'async' if r['async_checkpoint'] else 'sync'}): "
            f"step {1000 * r['step_time_s_median_without_save']:.1f} ms without a save, a save costs "
            + (f"{cost:.2f} s of step time" if cost is not None else "? (no save after warm-up)")
        )
        for sv in r["saves"]:
            print(
                f"  save after step {sv['step']}: blocked {sv['blocking_s']:.3f} s, waited "
                f"{sv['wait_for_previous_write_s']:.3f} s for the earlier write, staging {sv['staging_s']:.3f} s, write "
                f"{sv['write_s']:.2f} s at {sv['write_gb_per_s_per_rank']:.2f} GB/s per rank "
                f"({sv['bytes_per_rank'] / 1e9:.2f} GB per rank)"
            )
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
