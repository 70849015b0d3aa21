"""The training job: meshes → model on meta → EP plan → expert-aware FSDP2 → prefetch → weights → train.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m moeshard.train --config apps/train/configs/qwen3_30b_a3b_2x8.yaml

Loss: the mean over every label token of the global batch. FSDP averages gradients over the world (experts
included, see moeshard.fsdp_moe), so each rank back-propagates ``W · (sum of its token losses) / N_global``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeshard.train import checkpoint as ckpt
from moeshard.train.config import JobConfig
from moeshard.train.data import Batch, GlobalBatches, build_dataset
from moeshard.train.metrics import MetricsSink, flops_per_token, max_memory_gib, mfu


def print0(*args: Any) -> None:
    """Print on rank 0 only."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm; the last good checkpoint is kept."""


def init_distributed() -> torch.device:
    """Initialise the default process group from torchrun's environment (a world of one without it)."""
    if dist.is_initialized():
        rank = dist.get_rank()
    else:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    del rank
    return device


def resolve_model_config(cfg: JobConfig):
    """The transformers config of the model to train (preset or local dir), with overrides applied."""
    from moeshard.models.qwen3moe import get_preset_config, load_hf_config

    if cfg.model.path is not None:
        config = load_hf_config(cfg.model.path)
        for k, v in cfg.model.overrides.items():
            if not hasattr(config, k):
                raise ValueError(f"model.overrides.{k}: Qwen3MoeConfig has no field {k!r}")
            setattr(config, k, v)
        return config
    return get_preset_config(cfg.model.preset, **cfg.model.overrides)


def _run_identity(cfg: JobConfig) -> dict[str, Any]:
    # What makes two runs "the same run": model and data (steps, layout, logging and checkpointing may change).
    d = cfg.to_dict()
    train = {k: v for k, v in d["train"].items() if k != "steps"}
    return {"model": d["model"], "data": d["data"], "train": train}


def guard_output_dir(cfg: JobConfig, output_dir: Path, resuming: bool) -> None:
    """Refuse an output_dir that holds a different run, or the same run without resuming it."""
    run_file = output_dir / "run.json"
    if not run_file.is_file():
        return
    previous = json.loads(run_file.read_text())
    ident = _run_identity(cfg)
    if previous != ident:
        diff = [
            f"{s}.{k}"
            for s in ident
            for k in set(ident[s]) | set(previous.get(s, {}))
            if ident[s].get(k) != previous.get(s, {}).get(k)
        ]
        raise ValueError(
            f"logging.output_dir {output_dir} holds a different run (differs in {', '.join(sorted(diff))}); "
            "choose another logging.output_dir, or restore that run's settings to resume it"
        )
    if not resuming:
        raise ValueError(
            f"logging.output_dir {output_dir} already holds this run and checkpoint.resume is 'none'; "
            "nothing was overwritten. Use checkpoint.resume=auto to continue it, or another logging.output_dir"
        )


def lr_at(step: int, cfg: JobConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then cosine or constant."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


@dataclasses.dataclass
class Job:
    """Everything built for training, for the loop and for tests."""

    cfg: JobConfig
    device: torch.device
    meshes: Any
    model: torch.nn.Module
    model_config: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    units: Any
    schedule: Any


def build_job(cfg: JobConfig, device: torch.device) -> Job:
    """Compose the packages into a ready-to-train model and optimizer (weights loaded or initialised)."""
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import default_mp_policy, shard_model
    from moeshard.meshes import build_meshes
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, load_hf_weights
    from moeshard.prefetch import apply_schedule, build_schedule

    meshes = build_meshes(
        cfg.parallel.ep_size, device_type=device.type, allow_cross_node_ep=cfg.parallel.allow_cross_node_ep
    )
    mcfg = resolve_model_config(cfg)
    if cfg.data.seq_len > mcfg.max_position_embeddings:
        raise ValueError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
            f"{mcfg.max_position_embeddings}; lower data.seq_len"
        )
    if mcfg.num_experts % cfg.parallel.ep_size:
        raise ValueError(
            f"parallel.ep_size {cfg.parallel.ep_size} does not divide the model's {mcfg.num_experts} experts; "
            "choose an ep_size that divides the number of experts"
        )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(mcfg)
    if cfg.train.activation_checkpointing:
        model.enable_activation_checkpointing()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    compute_dtype = _compute_dtype(cfg, device)
    units = shard_model(
        model,
        meshes,
        mp_policy=_mp_policy(compute_dtype) if cfg.model.dtype != "auto" else default_mp_policy(device.type),
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )
    schedule = None
    if cfg.parallel.prefetch_depth > 0:
        schedule = build_schedule(units.stages, depth=cfg.parallel.prefetch_depth)
        apply_schedule(schedule)
    model.to_empty(device=device)
    if cfg.model.path is not None:
        load_hf_weights(model, cfg.model.path)
    else:
        torch.manual_seed(cfg.model.init_seed)
        model.init_weights()
    t = cfg.train
    # fused=True on GPU: one kernel per parameter group instead of ~10 foreach passes over every tensor (the
    # optimizer step was the largest single item of the step's profile); CPU keeps the reference for-loop.
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=t.lr,
        betas=t.betas,
        weight_decay=t.weight_decay,
        fused=fused,
        foreach=False if fused else None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / t.lr)
    return Job(cfg, device, meshes, model, mcfg, optimizer, scheduler, units, schedule)


def _mp_policy(dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _compute_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def train_step(job: Job, micro_batches: list[Batch], want_counts: bool = False) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches; returns global loss, aux loss and grad norm."""
    from moeshard.fsdp_moe import clip_grad_norm_

    model, device, W = job.model, job.device, dist.get_world_size()
    coef = float(getattr(job.model_config, "router_aux_loss_coef", 0.0))
    from moeshard.fsdp_moe import num_items_for_global_mean

    local_tokens = sum(int((b.labels[:, 1:] != -100).sum()) for b in micro_batches)  # CPU tensors: no sync
    # N_global / W on the device (no host sync): each rank's loss is W * sum_r / N_global, FSDP averages over W.
    num_items = num_items_for_global_mean(local_tokens).clamp_min(1.0 / W)
    lm_sum = torch.zeros((), device=device, dtype=torch.float32)
    aux_sum = torch.zeros((), device=device, dtype=torch.float32)
    counts = None
    for b in micro_batches:
        ids = b.input_ids.to(device, non_blocking=True)
        labels = b.labels.to(device, non_blocking=True)
        mask = b.attention_mask.to(device, non_blocking=True) if b.attention_mask is not None else None
        out = model(
            ids,
            labels=labels,
            attention_mask=mask,
            num_items_in_batch=num_items,
            output_router_logits=True,
            return_logits=False,
        )
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=device)
        lm = out.loss - coef * aux  # our model's loss includes coef * aux, as transformers'
        (lm + coef * aux / len(micro_batches)).backward()
        lm_sum += lm.detach().float()
        aux_sum += aux.detach().float() / len(micro_batches)
        if want_counts and out.router_logits is not None:
            counts = _expert_counts(out.router_logits, job.model_config, counts)
    grad_norm = clip_grad_norm_(model, job.cfg.train.max_grad_norm)
    stats = torch.stack([lm_sum, aux_sum])
    dist.all_reduce(stats)
    # Device tensors: the caller decides when to read them (one sync), so the step itself needs none.
    return {"loss": stats[0] / W, "aux_loss": stats[1] / W, "grad_norm": grad_norm, "counts": counts}


def host_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """Read a step's loss, aux loss and grad norm to the host in one transfer."""
    loss, aux, gnorm = torch.stack([stats["loss"], stats["aux_loss"], stats["grad_norm"].float()]).tolist()
    return {**stats, "loss": loss, "aux_loss": aux, "grad_norm": gnorm}


def _expert_counts(router_logits, config, acc):
    k = config.num_experts_per_tok
    per_layer = [
        torch.bincount(lg.topk(k, dim=-1).indices.flatten(), minlength=config.num_experts) for lg in router_logits
    ]
    counts = torch.stack(per_layer).cpu()
    return counts if acc is None else acc + counts


def run(cfg: JobConfig) -> dict[str, Any]:
    """Run the job under torchrun (or as a single process); returns a summary on every rank."""
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    output_dir = Path(cfg.logging.output_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir / "checkpoints"
    resume_path = None
    if cfg.checkpoint.resume == "auto":
        resume_path = ckpt.newest_checkpoint(ckpt_dir)
    elif cfg.checkpoint.resume != "none":
        resume_path = Path(cfg.checkpoint.resume)
        if not resume_path.is_dir():
            raise ValueError(f"checkpoint.resume {resume_path} does not exist; use auto, none or a checkpoint folder")
    guard_output_dir(cfg, output_dir, resuming=cfg.checkpoint.resume != "none")
    torch.manual_seed(cfg.train.seed)
    job = build_job(cfg, device)
    print0(job.meshes.describe())
    tok_cfg = job.model_config
    data = build_dataset(
        cfg.data,
        vocab_size=tok_cfg.vocab_size,
        eos_id=_first(tok_cfg.eos_token_id),
        pad_id=tok_cfg.pad_token_id if hasattr(tok_cfg, "pad_token_id") else None,
    )
    batches = GlobalBatches(
        len(data), cfg.train.global_batch_size, world, cfg.train.micro_batch_size, cfg.data.shuffle, cfg.data.seed
    )
    start_step = 0
    if resume_path is not None:
        from moeshard.fsdp_moe import set_state_dict

        state = _app_state(job)
        extra, rank_state = ckpt.load_checkpoint(resume_path, state)
        set_state_dict(job.model, state, job.optimizer)
        job.scheduler.load_state_dict(extra["scheduler"])
        start_step = int(extra["step"])
        if rank_state is not None:
            torch.set_rng_state(rank_state["cpu_rng"])
        print0(f"resumed from {resume_path} at step {start_step}")
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "run.json").write_text(json.dumps(_run_identity(cfg), indent=1))
        (output_dir / "config.yaml").write_text(_yaml(cfg))
    sink = MetricsSink(
        output_dir,
        enabled=rank == 0,
        tensorboard=cfg.logging.tensorboard,
        total_steps=cfg.train.steps,
        progress=cfg.logging.progress_bar,
    )
    sink.set_start(start_step)
    fpt = flops_per_token(tok_cfg, cfg.data.seq_len)
    losses: list[float] = []
    last_saved = ckpt.newest_checkpoint(ckpt_dir)
    try:
        for step in range(start_step, cfg.train.steps):
            t0 = time.perf_counter()
            micro = [data.collate(ix) for ix in batches.micro_batches(step, rank)]
            want_counts = bool(cfg.logging.expert_load_every) and (step + 1) % cfg.logging.expert_load_every == 0
            stats = host_stats(train_step(job, micro, want_counts))
            if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                raise TrainingDiverged(
                    f"step {step + 1}: non-finite loss {stats['loss']} or grad norm {stats['grad_norm']}; "
                    f"parameters were not updated and the last good checkpoint ({last_saved or 'none'}) is kept. "
                    "Lower train.lr or check the data"
                )
            job.optimizer.step()
            job.scheduler.step()
            job.optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            done = step + 1
            losses.append(stats["loss"])
            tokens = cfg.train.global_batch_size * cfg.data.seq_len / world
            if done % cfg.logging.every_steps == 0 or done == cfg.train.steps:
                tps = tokens / dt
                sink.log(
                    {
                        "step": done,
                        "loss": stats["loss"],
                        "aux_loss": stats["aux_loss"],
                        "grad_norm": stats["grad_norm"],
                        "lr": job.scheduler.get_last_lr()[0],
                        "tokens_per_s_per_gpu": tps,
                        "mfu": mfu(tps, fpt),
                        "max_memory_gib": max_memory_gib(device),
                        "step_time_s": dt,
                    }
                )
            if (
                stats["counts"] is not None
                and cfg.logging.expert_load_every
                and done % cfg.logging.expert_load_every == 0
            ):
                sink.expert_load(done, stats["counts"])
            sink.advance()
            if (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0) or done == cfg.train.steps:
                last_saved = save(job, ckpt_dir, done)
    finally:
        sink.close()
    return {"losses": losses, "start_step": start_step, "checkpoint": str(last_saved) if last_saved else None}


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _app_state(job: Job) -> dict[str, Any]:
    from moeshard.fsdp_moe import get_state_dict

    return get_state_dict(job.model, job.optimizer)


def save(job: Job, ckpt_dir: Path, step: int) -> Path:
    """Save an atomic, layout-independent checkpoint after ``step`` steps."""
    extra = {
        "step": step,
        "scheduler": job.scheduler.state_dict(),
        "world_size": dist.get_world_size(),
        "config": job.cfg.to_dict(),
    }
    rank_state = {"cpu_rng": torch.get_rng_state()}
    return ckpt.save_checkpoint(
        ckpt_dir, step, _app_state(job), extra, rank_state, keep_last=job.cfg.checkpoint.keep_last
    )


def _yaml(cfg: JobConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
