"""The training core: build the job, take one step, loop over steps.

    torchrun --nproc-per-node 4 -m moeshard.train --config apps/train/configs/default.yaml

- :func:`build`: meshes -> model on meta -> ``parallelize`` (EP -> activation checkpointing -> compile -> FSDP2 ->
  prefetch) -> memory -> weights (loaded or initialised) -> optimizer -> learning-rate schedule.
- :func:`train_step`: zero_grad -> forward/backward of each micro-batch -> clip -> optimizer step -> schedule.
- :func:`run`: the step loop over ``(step, micro_batches)`` (``moeshard.data``'s ``PrefetchLoader`` in the job).
  Timing, fault injection, communication accounting, metrics, the progress bar and checkpoints are
  :class:`Callback` objects (``moeshard.train.metrics``, ``faults``, ``comm_accounting``, ``checkpoint``);
  ``moeshard.train.job`` checks the inputs, resumes, opens the data and chooses them.

Loss: the mean over every label token of the global batch. FSDP averages gradients over the world (experts
included, see moeshard.fsdp_moe), so each rank back-propagates ``W · (sum of its token losses) / N_global``.
Packed rows (``moeshard.data.Batch``) give the model ``position_ids`` and ``document_ids``: a token attends only to
its own document.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from moeshard.data import Batch
from moeshard.train.config import JobConfig, parallel_options, resolve_model_config


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
    from moeshard.train.config import config_from_dict

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


def aux_loss_coef(cfg: JobConfig, model_config: Any) -> float:
    """``train.aux_loss.coef``, or the model config's ``router_aux_loss_coef`` when it is null."""
    coef = cfg.train.aux_loss.coef
    return float(getattr(model_config, "router_aux_loss_coef", 0.0) if coef is None else coef)


def balancing_options(cfg: JobConfig, model_config: Any):
    """The ``moeshard.models.qwen3moe.BalancingOptions`` of ``train.aux_loss``, ``train.z_loss_coef`` and
    ``train.router_bias``."""
    from moeshard.models.qwen3moe import BalancingOptions

    t = cfg.train
    return BalancingOptions(
        aux_loss_coef=aux_loss_coef(cfg, model_config),
        scope=t.aux_loss.scope,
        z_loss_coef=t.z_loss_coef,
        router_bias_rate=None if t.router_bias is None else t.router_bias.update_rate,
    )


def check_model_fits(cfg: JobConfig, model_config: Any) -> None:
    """Raises ValueError (naming the key to change) when the data or the layout do not fit the model."""
    if cfg.data.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
            f"{model_config.max_position_embeddings}; lower data.seq_len"
        )
    from moeshard.train.families import routed_experts

    if routed_experts(model_config) % cfg.parallel.ep_size:
        raise ValueError(
            f"parallel.ep_size {cfg.parallel.ep_size} does not divide the model's {routed_experts(model_config)} "
            "experts; choose an ep_size that divides the number of experts"
        )


# ---- build -------------------------------------------------------------------------------------------------------


@dataclass
class Job:
    """Everything built for training, for the loop and for tests."""

    cfg: JobConfig
    device: torch.device
    meshes: Any  # moeshard.meshes.ParallelMeshes
    model: torch.nn.Module
    model_config: Any  # the family's transformers config (Qwen3MoeConfig, DeepseekV3Config)
    parallel: Any  # moeshard.models.qwen3moe.Parallelized: FSDP units, prefetch schedule, EP info, options
    optimizer: Any  # moeshard.fsdp_moe.OptimizersContainer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    balancing: Any  # moeshard.models.qwen3moe.Balancing: aux loss, z-loss, router-bias updates


def build(cfg: JobConfig, device: torch.device) -> Job:
    """Compose the packages into a ready-to-train model and optimizer (weights loaded or initialised).

    Raises:
        ValueError: the layout or the data do not fit the model (see :func:`check_model_fits`).
    """
    from moeshard.fsdp_moe import build_optimizer
    from moeshard.meshes import build_meshes
    from moeshard.models.common import Balancing, load_hf_weights, parallelize
    from moeshard.train.families import family_of

    p, t = cfg.parallel, cfg.train
    meshes = build_meshes(p.ep_size, device_type=device.type, allow_cross_node_ep=p.allow_cross_node_ep)
    model_config = resolve_model_config(cfg)
    check_model_fits(cfg, model_config)
    with torch.device("meta"):
        model = family_of(model_config).model_class(model_config)  # model.family's causal LM
    parallel = parallelize(model, meshes, parallel_options(cfg))
    model.to_empty(device=device)
    if cfg.model.path is not None:
        load_hf_weights(model, cfg.model.path, ep_info=parallel.ep_info)  # each rank reads only its slices
    else:
        torch.manual_seed(cfg.model.init_seed)
        model.init_weights()
    if t.router_bias is not None:
        model.enable_router_bias()  # after the HF weights (no such tensor there), before a resume (DCP has it)
    optimizer = build_optimizer(
        model, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fuse_local_experts=t.fuse_local_experts
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / t.lr)
    balancing = Balancing(model, balancing_options(cfg, model_config), device=device)
    return Job(cfg, device, meshes, model, model_config, parallel, optimizer, scheduler, balancing)


# ---- one step ----------------------------------------------------------------------------------------------------


class HostStats(NamedTuple):
    """A step's figures on the host."""

    loss: float
    aux_loss: float
    grad_norm: float


@dataclass
class StepStats:
    """One optimizer step: the global mean loss (without the balancing terms), the mean router balancing (aux) loss
    and the gradient norm before clipping as device tensors, the learning rate the step used, what callbacks
    measured of the step (``extra``, e.g. ``step_time_s``, ``comm``: the metrics log it) and how many ranks asked to
    stop after it (``stop_votes``, see :attr:`stop_agreed`); ``z_loss`` (mean router z-loss, with
    ``train.z_loss_coef``), ``targets`` (predicted tokens of the step, all ranks) and ``expert_load``
    (``[layers, experts]`` tokens routed to each expert in the step, all ranks) are device tensors too, read in the
    same transfer (:attr:`host_targets`, :attr:`host_z_loss`, :attr:`host_expert_load`)."""

    loss: torch.Tensor
    aux_loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)
    stop_votes: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    _host: HostStats | None = field(default=None, repr=False)
    _stop: bool = field(default=False, repr=False)
    _more: dict[str, Any] = field(default_factory=dict, repr=False)

    def read(self) -> HostStats:
        """The figures on the host in one transfer (it waits for the step's backward); later calls reuse them."""
        if self._host is None:
            zero = torch.zeros((), device=self.loss.device)
            optional = [self.stop_votes, self.z_loss, self.targets]
            figures = [self.loss, self.aux_loss, self.grad_norm] + [zero if t is None else t for t in optional]
            flat = [torch.stack([f.double().to(self.loss.device) for f in figures])]
            if self.expert_load is not None:
                flat.append(self.expert_load.double().flatten().to(self.loss.device))
            host = torch.cat(flat).cpu()  # the one device -> host transfer of the step
            values = host[: len(figures)].tolist()
            self._host, self._stop = HostStats(*values[:3]), values[3] > 0
            self._more = {
                "z_loss": values[4] if self.z_loss is not None else None,
                "targets": int(values[5]) if self.targets is not None else None,
                "expert_load": host[len(figures) :].float().view(self.expert_load.shape)
                if self.expert_load is not None
                else None,
            }
        return self._host

    @property
    def host_targets(self) -> int | None:
        """Predicted (non-padding, labelled) tokens of the step, all ranks."""
        self.read()
        return self._more["targets"]

    @property
    def host_z_loss(self) -> float | None:
        """The mean router z-loss (None without ``train.z_loss_coef``)."""
        self.read()
        return self._more["z_loss"]

    @property
    def host_expert_load(self) -> torch.Tensor | None:
        """``[layers, experts]`` tokens per expert in the step, all ranks (a CPU tensor; None without MoE layers)."""
        self.read()
        return self._more["expert_load"]

    @property
    def stop_agreed(self) -> bool:
        """Whether any rank asked to stop after this step (``train_step(stop_requested=True)``). The votes are
        summed by the step's loss all-reduce, so every rank gets the same answer, in the same transfer as
        :meth:`read`'s figures."""
        self.read()
        return self._stop


def train_step(
    job: Job,
    micro_batches: Sequence[Batch],
    before_update: Callable[[StepStats], None] | None = None,
    *,
    stop_requested: bool = False,
) -> StepStats:
    """One optimizer step over this rank's micro-batches (gradient accumulation); no host sync of its own.

    zero_grad → per micro-batch: forward, backward of its LM loss plus ``job.balancing``'s term (aux loss of its
    scope, z-loss) → clip → optimizer step → schedule → the balancing's after-step hook (router-bias update).
    ``train.gradient_sync``: FSDP reduce-scatters each micro-batch's gradients (``every_micro_batch``) or their sum
    once, in the last backward (``last_micro_batch``, FSDP2's ``set_requires_gradient_sync``: every unit holds its
    unsharded float32 gradients meanwhile); the same gradients to float32 rounding.

    Args:
        before_update: called after backward and clipping, before the optimizer step (the loop's finiteness check
            reads the stats there; an exception leaves the parameters unchanged).
        stop_requested: this rank's vote to stop after this step, counted in ``StepStats.stop_votes``.
    """
    from moeshard.fsdp_moe import num_items_for_global_mean

    model, world, balancing = job.model, dist.get_world_size(), job.balancing
    lr = job.optimizer.param_groups[0]["lr"]
    job.optimizer.zero_grad(set_to_none=True)
    local_tokens = sum(b.num_targets for b in micro_batches)  # CPU tensors: no sync
    # N_global / W on the device (no host sync): each rank's loss is W * sum_r / N_global, FSDP averages over W.
    num_items = num_items_for_global_mean(local_tokens).clamp_min(1.0 / world)
    lm_sum = torch.zeros((), device=job.device, dtype=torch.float32)
    balancing.start_step(len(micro_batches))
    last, defer_sync = len(micro_batches) - 1, job.cfg.train.gradient_sync == "last_micro_batch"
    for m, b in enumerate(micro_batches):
        b = b.to(job.device, non_blocking=True)  # pinned by the loader on CUDA: an asynchronous copy
        out = model(
            b.input_ids,
            labels=b.labels,
            # Packed rows: positions restart and attention stays inside each document (document_ids -1: padding).
            position_ids=b.position_ids,
            document_ids=b.document_ids,
            attention_mask=b.attention_mask,  # None unless padded; keeps padding out of the router's aux loss too
            num_items_in_batch=num_items,
            output_router_logits=True,
            return_logits=False,  # the loss goes through the head in chunks, never holding [tokens, vocab] logits
        )
        if defer_sync and m in (0, last):
            # Off from the first backward, on for the last: the earlier backwards add into FSDP's unsharded
            # gradients, the last one reduce-scatters their sum once (experts kept out of FSDP reduce nothing).
            model.set_requires_gradient_sync(m == last)
        (out.lm_loss + balancing.micro_batch_loss(out, b.attention_mask)).backward()
        lm_sum += out.lm_loss.detach().float()
    # One norm over both meshes; the container may apply the clip coefficient inside its step (no extra pass).
    grad_norm = job.optimizer.clip_grad_norm_(job.cfg.train.max_grad_norm)
    step = balancing.end_step()  # the expert load over the step and all ranks
    stats = _step_stats(job, lm_sum, step, grad_norm, lr, local_tokens, stop_requested)
    if before_update is not None:
        before_update(stats)
    job.optimizer.step()
    job.scheduler.step()
    balancing.after_optimizer_step()  # the same counts on every rank: the same router biases
    return stats


def _step_stats(job: Job, lm_sum, step, grad_norm, lr: float, local_tokens, stop_requested: bool) -> StepStats:
    """The step's figures summed over the ranks in one all-reduce (the stop vote rides in it: every rank learns of
    any rank's vote at the same step, without a collective or a host sync of its own)."""
    world, device = dist.get_world_size(), job.device
    votes, targets = (  # torch.full is a fill kernel, not a host-to-device copy
        torch.full((), float(x), device=device, dtype=torch.float64) for x in (stop_requested, local_tokens)
    )
    z = step.z_loss if step.z_loss is not None else torch.zeros((), device=device)
    summed = torch.stack([lm_sum.double(), step.aux_loss.double(), z.double(), targets, votes])  # exact > 2**24
    dist.all_reduce(summed)
    return StepStats(
        summed[0] / world,
        summed[1] / world,
        grad_norm,
        lr,
        stop_votes=summed[4],
        z_loss=summed[2] / world if step.z_loss is not None else None,
        targets=summed[3],
        expert_load=step.expert_load,
    )


# ---- the loop ----------------------------------------------------------------------------------------------------


class Callback:
    """Hooks of :func:`run`, called in list order; override the ones you need (each default does nothing).
    ``step`` counts from 1, as in metrics.jsonl, checkpoint names and messages."""

    def on_run_start(self) -> None:
        """Before the first step."""

    def on_step_start(self, step: int) -> None:
        """Before the step takes its batch and its forward runs."""

    def before_update(self, step: int, stats: StepStats) -> None:
        """After backward and clipping, before the optimizer step; raising leaves the parameters unchanged."""

    def on_step_end(self, step: int, stats: StepStats) -> None:
        """After the optimizer step was issued (the device may still be running it)."""

    def on_run_end(self) -> None:
        """After the last step, or when the run stops with an exception."""


def run(
    job: Job,
    batches: Iterable[tuple[int, Sequence[Batch]]],
    callbacks: Sequence[Callback] = (),
    *,
    start_step: int = 0,
    stop_requested: Callable[[], bool] | None = None,
) -> StepStats | None:
    """Train from ``start_step`` (steps already taken) to ``cfg.train.steps``, or until the ranks agree to stop;
    returns the last step's stats.

    Nothing is kept per step (a run may take millions): a callback records what it needs (e.g. :class:`LossLog`).

    Args:
        batches: ``(step, this rank's micro-batches)`` for steps ``start_step, start_step + 1, ...`` (0-based), in
            order: a ``moeshard.data.PrefetchLoader`` (prepared in the background), or any iterable, e.g.
            ``((s, step_batches.micro_batches(s, rank)) for s in range(start_step, steps))``.
        stop_requested: this rank's wish to stop (e.g. a signal arrived), asked before each step's all-reduce. When
            any rank wishes it, every rank ends the run after that same step (its callbacks see
            ``stats.stop_agreed``; a checkpoint callback saves it).

    Raises:
        ValueError: ``batches`` ran out, or gave another step than the loop's next.
    """

    def each(hook: str, *args: Any) -> None:
        for callback in callbacks:
            getattr(callback, hook)(*args)

    stats = None
    steps = iter(batches)
    each("on_run_start")
    try:
        for step in range(start_step, job.cfg.train.steps):
            done = step + 1  # steps count from 1 in callbacks, metrics, checkpoints and messages
            each("on_step_start", done)
            given, micro_batches = next(steps, (None, None))
            if given != step:
                raise ValueError(f"the batches gave step {given} where the loop takes step {step} (0-based)")
            stats = train_step(
                job,
                micro_batches,
                before_update=functools.partial(each, "before_update", done),
                stop_requested=stop_requested is not None and stop_requested(),
            )
            each("on_step_end", done, stats)
            if stop_requested is not None and stats.stop_agreed:
                break
    finally:
        each("on_run_end")
    return stats


class LossLog(Callback):
    """Keeps each step's global loss on the host (a float per step; the read is the step's one read, cached)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, step: int, stats: StepStats) -> None:  # noqa: D102
        self.losses.append(stats.read().loss)
