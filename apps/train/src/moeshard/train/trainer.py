"""The training job: meshes → model on meta → EP plan → expert-aware FSDP2 → prefetch → weights → train.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        -m moeshard.train --config apps/train/configs/qwen3_30b_a3b_2x8.yaml

The run itself (checks, resume, loop, checkpoints) is in ``moeshard.train.runner``.

Loss: the mean over every label token of the global batch. FSDP averages gradients over the world (experts
included, see moeshard.fsdp_moe), so each rank back-propagates ``W · (sum of its token losses) / N_global``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moeshard.train.config import JobConfig
from moeshard.train.data import Batch


def init_distributed() -> torch.device:
    """Initialise the default process group from torchrun's environment (a world of one without it); returns
    this rank's device (CUDA where available, except under a gloo group the caller already initialised)."""
    if not dist.is_initialized():
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
    if dist.is_initialized() and dist.get_backend() == "gloo":
        # A gloo group set up by the caller (tests, CPU runs on a GPU machine): gloo sends no CUDA tensors.
        return torch.device("cpu")
    if torch.cuda.is_available():
        # Expandable segments: same speed, ~5 GiB less reserved memory at the 8-layer benchmark (fewer fragments
        # from the per-step varying expert token counts). A user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(minutes=30))
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
    if cfg.train.compile:
        from moeshard.models.qwen3moe import set_compiled_kernels

        set_compiled_kernels(True)
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    units = shard_model(
        model,
        meshes,
        mp_policy=default_mp_policy(device.type) if cfg.model.dtype == "auto" else _mp_policy(cfg.model.dtype),
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )
    schedule = None
    if cfg.parallel.prefetch_depth > 0:
        schedule = build_schedule(units.stages, depth=cfg.parallel.prefetch_depth)
        apply_schedule(schedule)
        if cfg.parallel.prefetch_at_host_sync and meshes.ep_size > 1:
            from moeshard.ep import register_host_sync_hook
            from moeshard.prefetch import prefetch_forward_at_host_sync

            # The next layer's all-gather is issued while the host waits at this layer's split-size sync.
            prefetch_forward_at_host_sync(schedule, register_host_sync_hook)
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
    if t.fused_expert_update:
        from moeshard.fsdp_moe import fuse_local_expert_updates

        # Experts kept out of FSDP (ep_fsdp of one rank): one pass per step reads their compute-dtype gradients and
        # writes the master weights, the moments and the next forward's compute copy (no-op under expert FSDP).
        fuse_local_expert_updates(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / t.lr)
    return Job(cfg, device, meshes, model, mcfg, optimizer, scheduler, units, schedule)


def _mp_policy(dtype: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # An explicit model.dtype is the compute dtype; master weights and gradient reduction stay float32.
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)


def train_step(job: Job, micro_batches: list[Batch], want_counts: bool = False) -> dict[str, Any]:
    """Forward, backward and clipping over this rank's micro-batches; returns global loss, aux loss and grad norm.

    The caller runs ``job.optimizer.step()`` next: with a fused optimizer the clipping happens in that step (see
    ``moeshard.fsdp_moe.clip_grad_norm_``'s ``optimizer`` argument).
    """
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
    # With the fused AdamW (GPU) the clip coefficient is applied inside the caller's next job.optimizer.step() (no
    # separate multiply kernel over the gradients); until then the gradients stay unclipped. Others clip in place.
    grad_norm = clip_grad_norm_(model, job.cfg.train.max_grad_norm, optimizer=job.optimizer)
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
