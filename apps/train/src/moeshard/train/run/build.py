"""Building the job: the process group, the learning-rate schedule, and ``build`` (the parallel model, its weights,
the optimizer, the balancing). The step is :mod:`moeshard.train.run.step`, the loop :mod:`moeshard.train.run.loop`.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml

:func:`build`: meshes -> model on meta -> LoRA adapters (``lora``: before ``parallelize``, whose EP plan then slices the
expert adapters with their experts) -> ``parallelize`` (EP -> activation checkpointing -> compile -> FSDP2 ->
prefetch) -> memory -> weights (loaded or initialised; then the adapters' values) -> optimizer -> learning-rate
schedule -> balancing.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moeshard.fsdp_moe import ExpertGradOptions, build_optimizer, default_mp_policy
from moeshard.lora import LoraAdapters, apply_lora, load_adapter, reset_adapters, set_adapters
from moeshard.meshes import build_meshes
from moeshard.models.common import Balancing, BalancingOptions, load_hf_weights, parallelize
from moeshard.train.config import JobConfig, config_from_dict, parallel_options
from moeshard.train.families import family_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from moeshard.fsdp_moe import OptimizersContainer
    from moeshard.meshes import ParallelMeshes
    from moeshard.models.common import Parallelized


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
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if dist.is_initialized() and dist.get_backend() == "gloo":
        # A gloo group set up by the caller (tests, CPU runs on a GPU machine): gloo sends no CUDA tensors.
        return torch.device("cpu")
    if torch.cuda.is_available():
        # Expandable segments: same speed, less reserved memory (fewer fragments from the per-step varying expert
        # token counts). A user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        if not dist.is_initialized():
            # NCCL for CUDA tensors, gloo for the few CPU ones (the ranks' agreement on a checkpoint save, the
            # output-dir lock, DCP's planning): one default group serves both.
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timedelta(minutes=30))
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    return device


def lr_at(step: int, cfg: JobConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then

    - ``cosine``: from ``lr`` to ``min_lr`` over the steps after warm-up;
    - ``constant``: ``lr``;
    - ``wsd`` (warmup-stable-decay): ``lr`` until the last ``decay_fraction`` of ``train.steps``, then down to
      ``min_lr`` (reached at the last step) along ``decay_shape``: ``linear``, ``cosine`` or ``1-sqrt``
      (``1 - sqrt(progress)``, Hägele et al. 2024).
    """
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        start = max(t.warmup_steps, t.steps - max(1, round(t.decay_fraction * t.steps)))
        if step < start:
            return t.lr
        progress = min(1.0, (step - start + 1) / max(1, t.steps - start))
        left = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}.get(
            t.decay_shape, 1 - math.sqrt(progress)
        )
        return t.min_lr + (t.lr - t.min_lr) * left
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


SCHEDULE_KEYS = ("steps", "min_lr", "warmup_steps", "schedule", "decay_fraction", "decay_shape")
"""The ``train`` keys of the learning-rate schedule a resume may change (see :func:`schedule_change`); the peak
``lr`` is part of the run."""


def schedule_change(saved: dict[str, Any], cfg: JobConfig, step: int) -> str | None:
    """One line on what a resume after ``step`` steps does to the learning rate when the schedule keys of the
    checkpoint's ``train`` section (``saved``) differ from this run's, else None. This run's schedule decides."""
    now = cfg.to_dict()["train"]
    changed = [f"train.{k} {saved.get(k)} -> {now[k]}" for k in SCHEDULE_KEYS if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    try:
        keys = (*SCHEDULE_KEYS, "lr")
        before = lr_at(step, config_from_dict({"train": {k: saved[k] for k in keys if k in saved}}))
        was = f" (the checkpoint's schedule: {before:.3g})"
    except ValueError:  # a saved value this version refuses
        was = ""
    end = lr_at(cfg.train.steps - 1, cfg) if step < cfg.train.steps else None
    return (
        f"resuming after step {step} with a changed schedule ({'; '.join(changed)}): the learning rate follows this "
        f"run's schedule from here, {lr_at(step, cfg):.3g} at step {step + 1}{was}"
        + (f", {end:.3g} at its last step {cfg.train.steps}" if end is not None else "")
    )


def aux_loss_coef(cfg: JobConfig, model_config: PretrainedConfig) -> float:
    """``train.aux_loss.coef``, or the model config's ``router_aux_loss_coef`` when it is null."""
    coef = cfg.train.aux_loss.coef
    return float(getattr(model_config, "router_aux_loss_coef", 0.0) if coef is None else coef)


def balancing_options(cfg: JobConfig, model_config: PretrainedConfig) -> BalancingOptions:
    """The ``moeshard.models.common.BalancingOptions`` of ``train.aux_loss``, ``train.z_loss_coef`` and
    ``train.router_bias``."""
    t = cfg.train
    return BalancingOptions(
        aux_loss_coef=aux_loss_coef(cfg, model_config),
        scope=t.aux_loss.scope,
        z_loss_coef=t.z_loss_coef,
        router_bias_rate=None if t.router_bias is None else t.router_bias.update_rate,
    )


# ---- build -------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """Everything built for training, for the loop and for tests."""

    cfg: JobConfig
    device: torch.device
    meshes: ParallelMeshes
    model: torch.nn.Module
    model_config: PretrainedConfig
    parallel: Parallelized  # FSDP units, prefetch schedule, EP info, options
    optimizer: OptimizersContainer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    balancing: Balancing  # aux loss, z-loss, router-bias updates
    adapters: LoraAdapters | None = None  # lora: the adapters (the only trained tensors); None without LoRA


def compute_dtype(cfg: JobConfig, device_type: str) -> torch.dtype:
    """The dtype the forward computes in: ``parallel.param_dtype``, or for ``auto`` the FSDP mixed-precision
    default of the device (bf16 on CUDA, float32 elsewhere)."""
    if cfg.parallel.param_dtype != "auto":
        return getattr(torch, cfg.parallel.param_dtype)
    return default_mp_policy(device_type).param_dtype or torch.float32


def base_model_name(cfg: JobConfig) -> str | None:
    """What an adapter of this job names as its base model (PEFT's ``base_model_name_or_path``): ``model.path``,
    absolute, or the preset's name."""
    if cfg.model.path is not None:
        return os.path.abspath(cfg.model.path)
    return cfg.model.preset


def build(cfg: JobConfig, device: torch.device, model_config: PretrainedConfig) -> Job:
    """Compose the packages into a ready-to-train model and optimizer (weights loaded or initialised).

    Args:
        model_config: the model config :func:`moeshard.train.config.check_layout` resolved and checked against
            ``cfg`` (``run.prepare`` hands it on as ``Prepared.model_config``); it is not resolved again here.

    Raises:
        ValueError: a weights file under ``model.path`` cannot be read.
    """
    p, t = cfg.parallel, cfg.train
    meshes = build_meshes(
        p.ep_size, device_type=device.type, allow_cross_node_ep=p.allow_cross_node_ep, sp_size=p.sp_size
    )
    with torch.device("meta"):
        model = family_of(model_config).model_class(model_config)  # model.family's causal LM
    adapters = None
    if cfg.lora.enabled:
        # Before parallelize: its EP plan names the expert adapters beside their experts (sliced on dim 0 with
        # them). The frozen base is held in the compute dtype: no float32 master, gradient or optimizer state.
        base_dtype = compute_dtype(cfg, device.type)
        adapters = apply_lora(model, cfg.lora, seed=cfg.train.seed, base_dtype=base_dtype)
    parallel = parallelize(model, meshes, parallel_options(cfg))
    model.to_empty(device=device)
    if cfg.model.path is not None:
        load_hf_weights(model, cfg.model.path, ep_info=parallel.ep_info)  # each rank reads only its slices
    else:
        torch.manual_seed(cfg.model.init_seed)
        model.init_weights()
    if adapters is not None:  # the base's loaders leave the adapters alone: their values come now
        ep_rank = parallel.ep_info.ep_rank
        if cfg.lora.init_from is not None:
            tensors = load_adapter(cfg.lora.init_from, adapters, base_model=base_model_name(cfg))
            set_adapters(model, adapters, tensors, ep_rank=ep_rank)
        else:
            reset_adapters(model, adapters, cfg.train.seed, ep_rank=ep_rank)
    if t.router_bias is not None:
        model.enable_router_bias()  # after the HF weights (no such tensor there), before a resume (DCP has it)
    # train.expert_weight_grads: the optimizer keeps the local experts' weight gradients of a step's micro-batches
    # as factors and forms them in its last backward, by itself (the trainer calls nothing for it).
    micro_batches = max(1, t.global_batch_size // meshes.dp_size // t.micro_batch_size)
    expert_grads = ExpertGradOptions(micro_batches=micro_batches, mode=t.expert_weight_grads)
    optimizer = build_optimizer(
        model,
        lr=t.lr,
        betas=t.betas,
        weight_decay=t.weight_decay,
        fuse_local_experts=t.fuse_local_experts,
        expert_grads=expert_grads,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / t.lr)
    # Under sequence parallelism the balancing's statistics are summed over the ranks sharing each row.
    sequence_group = meshes.sp.get_group() if meshes.sp is not None else None
    balancing = Balancing(model, balancing_options(cfg, model_config), device=device, sequence_group=sequence_group)
    return Job(cfg, device, meshes, model, model_config, parallel, optimizer, scheduler, balancing, adapters)
