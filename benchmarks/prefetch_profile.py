"""Step time and exposed all-gather time with and without the prefetch schedule, on the Qwen3-30B-A3B geometry.

    source benchmarks/gpu_env.sh
    torchrun --standalone --nproc-per-node 2 benchmarks/prefetch_profile.py --out /tmp/out/prefetch.json
    torchrun --standalone --nproc-per-node 1 benchmarks/prefetch_profile.py --out /tmp/out/prefetch1.json
    # CPU smoke test of the plumbing (gloo, no kernels, so no all-gather time):
    torchrun --standalone --nproc-per-node 2 benchmarks/prefetch_profile.py --preset tiny --seq-len 64 --layers 4

One model (8 layers by default, meta → ``parallelize`` without a prefetch schedule (EP → expert-aware FSDP2) →
materialised), bf16 compute with fp32 master
weights and fp32 gradient reduction, AdamW, micro-batch 1 × seq 4096 of random tokens. For each prefetch depth
(0 = FSDP2's default, 1, 2) the schedule is applied to the same model, then: warm-up steps, timed steps (median),
and profiled steps whose CUDA kernels give the exposed all-gather time (all-gather kernel time during which the
compute stream runs nothing; see ``moeshard.prefetch.analyze_comm_overlap``). Rank 0 prints a table and writes
JSON to ``--out``.

Expert all-gathers need ep_fsdp > 1: on 2 GPUs keep ``--ep-size 1`` (experts sharded 2 ways on dim 1); with
``--ep-size 2`` the experts are no FSDP units (ep_fsdp of one rank) and only the non-expert units are
all-gathered. On 1 GPU nothing is all-gathered at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def print0(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def init_distributed() -> torch.device:
    """The default process group from torchrun's environment (a world of one without it)."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    os.environ.setdefault("MASTER_PORT", "29517")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=20))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=20))
    return device


def build(args: argparse.Namespace, device: torch.device):
    """The sharded model, its FSDP stages, the optimizer and the vocab size."""
    from moeshard.fsdp_moe import build_optimizer
    from moeshard.meshes import build_meshes
    from moeshard.models.common import ParallelOptions, parallelize
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    meshes = build_meshes(args.ep_size, device_type=device.type)
    config = get_preset_config(args.preset, num_hidden_layers=args.layers)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    # No schedule here (prefetch_depth 0): run_config applies each depth's schedule to this one model. Compute in
    # bf16 on CUDA, float32 on CPU (param_dtype auto).
    parallel = parallelize(model, meshes, ParallelOptions(prefetch_depth=0))
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    optim = build_optimizer(model, lr=1e-5)
    print0(meshes.describe())
    return model, parallel.units.stages, optim, config.vocab_size, meshes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(args, device, model, stages, optim, vocab: int, depth: int) -> dict:
    """Apply the schedule of ``depth``; warm up, time and profile; return this rank's numbers."""
    from torch.profiler import ProfilerActivity, profile

    from moeshard.prefetch import analyze_comm_overlap, apply_schedule, build_schedule

    schedule = build_schedule(stages, depth=depth)
    apply_schedule(schedule)
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(device)

    def step() -> torch.Tensor:
        loss = model(ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(args.warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - t0)
    # Kernels are all the analysis reads; leaving out CPU ops keeps the trace small on GPU.
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        sync(device)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="prefetch_profile_")
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"depth{depth}_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    overlap = analyze_comm_overlap(path)
    if args.trace_dir is None:
        os.remove(path)
    n = args.profile_steps
    return {
        "depth": depth,
        "step_s_median": statistics.median(times),
        "step_s": times,
        "exposed_all_gather_s_per_step": overlap.exposed_all_gather_s / n,
        "all_gather_s_per_step": overlap.all_gather_s / n,
        "exposed_comm_s_per_step": overlap.exposed_comm_s / n,
        "compute_s_per_step": overlap.compute_s / n,
        "profile": overlap.as_dict(),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "loss": float(loss),
        "schedule": schedule.as_dict(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", help="model geometry (tiny: CPU smoke test)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1, help="1 on 2 GPUs so that experts are all-gathered (ep_fsdp 2)")
    p.add_argument("--depths", default="0,1,2", help="prefetch depths to compare; 0 = FSDP2's default")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per depth (median reported)")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--trace-dir", default=None, help="keep the Chrome traces here (deleted otherwise)")
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    args = p.parse_args()

    device = init_distributed()
    model, stages, optim, vocab, meshes = build(args, device)
    if meshes.ep_fsdp_size == 1:
        print0("note: ep_fsdp size 1: the experts are no FSDP units (only non-expert units are all-gathered)")
    from moeshard.prefetch import build_schedule

    print0(build_schedule(stages, depth=1).describe())
    results = []
    for depth in (int(d) for d in args.depths.split(",")):
        mine = run_config(args, device, model, stages, optim, vocab, depth)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {k: v for k, v in mine.items() if k != "schedule"})
        mine["per_rank"] = everyone
        mine["step_s_median_max_over_ranks"] = max(r["step_s_median"] for r in everyone)
        mine["exposed_all_gather_s_per_step_max_over_ranks"] = max(r["exposed_all_gather_s_per_step"] for r in everyone)
        results.append(mine)
        print0(
            f"depth {depth}: step {1e3 * mine['step_s_median']:.1f} ms, exposed all-gather "
            f"{1e3 * mine['exposed_all_gather_s_per_step']:.2f} ms/step, loss {mine['loss']:.4f}"
        )

    head = f"{'depth':>5} {'step ms':>9} {'AG ms':>8} {'exposed AG ms':>14} {'exposed comm ms':>16} {'peak GiB':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        peak = f"{r['peak_allocated_gib']:.1f}" if r["peak_allocated_gib"] is not None else "-"
        lines.append(
            f"{r['depth']:>5} {1e3 * r['step_s_median_max_over_ranks']:>9.1f} {1e3 * r['all_gather_s_per_step']:>8.2f} "
            f"{1e3 * r['exposed_all_gather_s_per_step_max_over_ranks']:>14.2f} "
            f"{1e3 * r['exposed_comm_s_per_step']:>16.2f} {peak:>9}"
        )
    print0(
        f"\n{args.preset} x {args.layers} layers, seq {args.seq_len}, micro-batch {args.micro_batch}, "
        f"world {meshes.world_size} = ep {meshes.ep_size} x ep_fsdp {meshes.ep_fsdp_size}, "
        f"torch {torch.__version__}\n(per step; step ms and exposed AG ms: the slowest rank; AG and exposed comm ms: rank 0)\n"
        + "\n".join(lines)
    )
    if args.out and dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        meta = {
            "preset": args.preset,
            "layers": args.layers,
            "seq_len": args.seq_len,
            "micro_batch": args.micro_batch,
            "world_size": meshes.world_size,
            "ep_size": meshes.ep_size,
            "ep_fsdp_size": meshes.ep_fsdp_size,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
        with open(args.out, "w") as f:
            json.dump({"config": meta, "results": results}, f, indent=1)
        print0(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
