"""One training run: checks → process group → model → resume → step loop (metrics, checkpoints) → summary.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml

Everything that can be checked without a process group is checked first, on every rank alike, before anything is
written: the layout, batch sizes, the model config, the output directory, the checkpoint to resume and the data.
Such problems raise :class:`~moeshard.train.errors.JobError` (rank 0 prints it as one line). A run resumes from the
newest complete checkpoint with ``checkpoint.resume: auto`` (also after ``torchrun --max-restarts`` restarts it)
and then computes the same losses as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeshard.models.qwen3moe import STRUCTURAL_CONFIG_KEYS
from moeshard.train import checkpoint as ckpt
from moeshard.train import faults
from moeshard.train.config import JobConfig
from moeshard.train.data import GlobalBatches, TokenDataset, build_dataset, check_batch_sizes
from moeshard.train.errors import JobError, TrainingDiverged
from moeshard.train.metrics import MetricsSink, flops_per_token, max_memory_gib, mfu
from moeshard.train.trainer import Job, build_job, host_stats, init_distributed, lr_at, resolve_model_config, train_step


def print0(*args: Any) -> None:
    """Print on rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def run_identity(cfg: JobConfig) -> dict[str, Any]:
    """What makes two runs "the same run": model, data and optimisation (steps, layout, logging and
    checkpointing may change between a run and its resumption)."""
    d = cfg.to_dict()
    train = {k: v for k, v in d["train"].items() if k != "steps"}
    return {"model": d["model"], "data": d["data"], "train": train}


def guard_output_dir(cfg: JobConfig, output_dir: Path, resuming: bool) -> None:
    """Refuse an output_dir that holds a different run, or the same run without resuming it.

    Raises:
        JobError: naming the differing keys and the way out; nothing has been written.
    """
    run_file = output_dir / "run.json"
    if not run_file.is_file():
        if (output_dir / "metrics.jsonl").exists():
            raise JobError(
                f"logging.output_dir {output_dir} holds metrics.jsonl but no run.json (not a moeshard-train run); "
                "nothing was overwritten. Choose another logging.output_dir"
            )
        return
    previous = json.loads(run_file.read_text())
    ident = run_identity(cfg)
    if previous != ident:
        diff = [
            f"{s}.{k}"
            for s in ident
            for k in set(ident[s]) | set(previous.get(s, {}))
            if ident[s].get(k) != previous.get(s, {}).get(k)
        ]
        raise JobError(
            f"logging.output_dir {output_dir} holds a different run (differs in {', '.join(sorted(diff))}); "
            "nothing was overwritten. Choose another logging.output_dir, or restore that run's settings to resume it"
        )
    if not resuming:
        raise JobError(
            f"logging.output_dir {output_dir} already holds this run and checkpoint.resume is 'none'; "
            "nothing was overwritten. Use checkpoint.resume=auto to continue it, or another logging.output_dir"
        )


@dataclass
class Prepared:
    """What the checks produced: the model config, the data, where to write and what to resume."""

    model_config: Any
    data: TokenDataset
    batches: GlobalBatches
    output_dir: Path
    ckpt_dir: Path
    resume_path: Path | None
    rank: int
    world_size: int
    ranks_per_node: int


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def prepare(cfg: JobConfig) -> Prepared:
    """Every check that needs no process group, on every rank alike, before anything is written.

    The world comes from torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` / ``RANK`` (a world of one without them).

    Raises:
        JobError: one message naming the problem and its fix.
    """
    from moeshard.meshes import plan_layout

    world = _env_int("WORLD_SIZE", 1)
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    rank = _env_int("RANK", 0)
    p = cfg.parallel
    try:
        try:
            plan_layout(world, per_node, p.ep_size, allow_cross_node_ep=p.allow_cross_node_ep)
        except ValueError as e:  # the package speaks of its argument; the user sets a config key
            msg = str(e).replace("pass allow_cross_node_ep=True", "set parallel.allow_cross_node_ep=true")
            raise ValueError(f"parallel.ep_size: {msg}") from None
        check_batch_sizes(cfg.train.global_batch_size, world, cfg.train.micro_batch_size)
        mcfg = resolve_model_config(cfg)
        if cfg.data.seq_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
                f"{mcfg.max_position_embeddings}; lower data.seq_len"
            )
        if mcfg.num_experts % p.ep_size:
            raise ValueError(
                f"parallel.ep_size {p.ep_size} does not divide the model's {mcfg.num_experts} experts; "
                "choose an ep_size that divides the number of experts"
            )
        output_dir = Path(cfg.logging.output_dir)
        ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir / "checkpoints"
        if _env_int("TORCHELASTIC_MAX_RESTARTS", 0) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            print0(
                "note: torchrun shares its rendezvous store with the workers; restarted workers may then fail to "
                "connect (torch 2.13, gloo). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun to restart reliably"
            )
        resume = cfg.checkpoint.resume
        if resume == "none" and _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0:
            print0("restarted by torchrun: continuing this run from its newest complete checkpoint")
            resume = "auto"
        resume_path = None
        if resume == "auto":
            resume_path = ckpt.newest_checkpoint(ckpt_dir)
        elif resume != "none":
            resume_path = Path(resume)
            if not resume_path.is_dir():
                raise ValueError(
                    f"checkpoint.resume {resume_path} does not exist; use auto, none or a checkpoint folder"
                )
            ckpt.read_marker(resume_path)
        if resume_path is not None:
            _check_same_model(resume_path, mcfg)
        guard_output_dir(cfg, output_dir, resuming=resume != "none")
        data = build_dataset(
            cfg.data,
            vocab_size=mcfg.vocab_size,
            eos_id=_first(mcfg.eos_token_id),
            pad_id=getattr(mcfg, "pad_token_id", None),
        )
        batches = GlobalBatches(
            len(data), cfg.train.global_batch_size, world, cfg.train.micro_batch_size, cfg.data.shuffle, cfg.data.seed
        )
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from e
    return Prepared(mcfg, data, batches, output_dir, ckpt_dir, resume_path, rank, world, per_node)


def _check_same_model(path: Path, mcfg: Any) -> None:
    extra_file = path / "extra.pt"
    if not extra_file.is_file():
        raise ValueError(
            f"{path} has no extra.pt: it is not a moeshard-train checkpoint; point checkpoint.resume elsewhere"
        )
    saved = torch.load(extra_file, weights_only=False).get("model_config") or {}
    diff = [k for k in STRUCTURAL_CONFIG_KEYS if k in saved and saved[k] != getattr(mcfg, k, None)]
    if diff:
        raise ValueError(
            f"checkpoint {path} holds another model (differs in {', '.join(diff)}); resume it with its own model "
            "settings, or start this model without checkpoint.resume"
        )


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) else x


def app_state(job: Job) -> dict[str, Any]:
    """Model and optimizer state for DCP (layout independent, see ``moeshard.fsdp_moe.get_state_dict``)."""
    from moeshard.fsdp_moe import get_state_dict

    return get_state_dict(job.model, job.optimizer)


def save(job: Job, ckpt_dir: Path, step: int) -> Path:
    """Save an atomic, layout-independent checkpoint after ``step`` steps (model, optimizer, scheduler, data
    position, RNG)."""
    extra = {
        "step": step,
        "scheduler": job.scheduler.state_dict(),
        "world_size": dist.get_world_size(),
        "config": job.cfg.to_dict(),
        "model_config": job.model_config.to_dict(),
        # The data order is a pure function of the step (moeshard.train.data), so the step is the position.
        "data": {"step": step, "samples_seen": step * job.cfg.train.global_batch_size},
    }
    rank_state = {"cpu_rng": torch.get_rng_state()}
    if job.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(job.device)
    return ckpt.save_checkpoint(
        ckpt_dir, step, app_state(job), extra, rank_state, keep_last=job.cfg.checkpoint.keep_last
    )


def resume(job: Job, path: Path) -> int:
    """Load a checkpoint of any layout into the job; returns the step it was taken after."""
    from moeshard.fsdp_moe import set_state_dict

    state = app_state(job)
    extra, rank_state = ckpt.load_checkpoint(path, state)
    set_state_dict(job.model, state, job.optimizer)
    job.scheduler.load_state_dict(extra["scheduler"])
    step = int(extra["step"])
    lr = lr_at(step, job.cfg)  # train.steps may have changed: the schedule of this run decides
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    job.scheduler._last_lr = [lr] * len(job.optimizer.param_groups)
    if rank_state is not None:  # same world size: each rank continues its own random stream
        torch.set_rng_state(rank_state["cpu_rng"])
        if "cuda_rng" in rank_state and job.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"], job.device)
    return step


@contextlib.contextmanager
def _nan_loss(job: Job, enabled: bool):
    """Test hook (``MOESHARD_FAULT=nan_loss:...``): this rank's loss becomes NaN for the step."""
    if not enabled:
        yield
        return

    def poison(module, args, output):
        output.loss = output.loss * float("nan")
        return output

    handle = job.model.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()


def _comm_accounting(job: Job, prep: Prepared):
    from moeshard.train.comm_accounting import CommAccounting

    m = job.meshes
    labels = {m.ep.get_group(): "ep", m.ep_fsdp.get_group(): "ep_fsdp", m.fsdp.get_group(): "fsdp"}
    return CommAccounting(labels, prep.ranks_per_node)


def _gather_comm(acct: Any) -> dict[str, Any]:
    from moeshard.train.comm_accounting import merge_ranks

    snap = acct.snapshot()
    with acct.paused():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, snap)
    return merge_ranks(gathered)


def run(cfg: JobConfig) -> dict[str, Any]:
    """Run the job under torchrun (or as a single process); returns a summary on every rank.

    Returns:
        ``{"losses": [...] (steps run by this call), "start_step": int, "checkpoint": newest saved or None,
        "job": the trained Job (model, optimizer, meshes)}``.

    Raises:
        JobError: bad inputs, a diverged loss, a failed checkpoint save (every rank raises it alike).
    """
    prep = prepare(cfg)
    faults.configure(prep.output_dir, prep.rank)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(cfg.train.seed)
        job = build_job(cfg, device)
        print0(job.meshes.describe())
        start_step = 0
        if prep.resume_path is not None:
            start_step = resume(job, prep.resume_path)
            print0(f"resumed from {prep.resume_path} at step {start_step}")
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from e
    if rank == 0:
        prep.output_dir.mkdir(parents=True, exist_ok=True)
        (prep.output_dir / "run.json").write_text(json.dumps(run_identity(cfg), indent=1))
        (prep.output_dir / "config.yaml").write_text(_yaml(cfg))
    sink = MetricsSink(
        prep.output_dir,
        enabled=rank == 0,
        tensorboard=cfg.logging.tensorboard,
        total_steps=cfg.train.steps,
        progress=cfg.logging.progress_bar,
        start_step=start_step,
    )
    fpt = flops_per_token(job.model_config, cfg.data.seq_len)
    tokens_per_rank = cfg.train.global_batch_size * cfg.data.seq_len / world
    losses: list[float] = []
    last_saved = ckpt.newest_checkpoint(prep.ckpt_dir)
    acct = _comm_accounting(job, prep) if cfg.logging.comm_accounting else None
    try:
        with acct if acct is not None else contextlib.nullcontext():
            t_read = time.perf_counter()
            for step in range(start_step, cfg.train.steps):
                done = step + 1  # steps are counted from 1 in metrics, checkpoints and messages
                lr = job.optimizer.param_groups[0]["lr"]
                if acct is not None:
                    acct.reset()
                micro = [prep.data.collate(ix) for ix in prep.batches.micro_batches(step, rank)]
                every = cfg.logging.expert_load_every
                want_counts = bool(every) and done % every == 0
                with _nan_loss(job, faults.poison_loss(done)):
                    step_stats = train_step(job, micro, want_counts)
                faults.at_step(done)
                # The step's one read (it waits for the end of its backward): the optimizer step below runs only
                # after the loss and norm were found finite. Nothing waits for the optimizer step: the host goes on
                # to the next step's batch and forward while the device still updates, so the step time is the
                # time between two of these reads.
                stats = host_stats(step_stats)
                now = time.perf_counter()
                dt, t_read = now - t_read, now
                if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                    raise TrainingDiverged(
                        f"step {done}: non-finite loss {stats['loss']} or grad norm {stats['grad_norm']}; the "
                        f"parameters were not updated and the last good checkpoint ({last_saved or 'none'}) is kept. "
                        "Lower train.lr or check the data, then resume"
                    )
                job.optimizer.step()
                job.scheduler.step()
                job.optimizer.zero_grad(set_to_none=True)
                comm = _gather_comm(acct) if acct is not None else None
                losses.append(stats["loss"])
                if done % cfg.logging.every_steps == 0 or done == cfg.train.steps:
                    tps = tokens_per_rank / dt
                    record = {
                        "step": done,
                        "loss": stats["loss"],
                        "aux_loss": stats["aux_loss"],
                        "grad_norm": stats["grad_norm"],
                        "lr": lr,
                        "tokens_per_s_per_gpu": tps,
                        "mfu": mfu(tps, fpt),
                        "max_memory_gib": max_memory_gib(device),
                        "step_time_s": dt,
                    }
                    if comm is not None:
                        record["comm"] = comm
                    sink.log(record)
                if stats["counts"] is not None:
                    sink.expert_load(done, stats["counts"])
                sink.advance()
                if (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0) or (
                    done == cfg.train.steps and cfg.checkpoint.save_final
                ):
                    last_saved = save(job, prep.ckpt_dir, done)
                    t_read = time.perf_counter()  # the save's time is no step's
    finally:
        sink.close()
    return {
        "losses": losses,
        "start_step": start_step,
        "checkpoint": str(last_saved) if last_saved else None,
        "job": job,
    }


def _yaml(cfg: JobConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
