"""One optimizer step: :func:`train_step` (zero_grad -> forward/backward of each micro-batch with the balancing's
hooks -> clip -> optimizer step -> schedule) and its figures (:class:`StepStats`, read in one device -> host transfer).

Loss: the mean over every label token of the global batch. FSDP averages gradients over the world (experts
included, see moeshard.fsdp_moe), so each rank back-propagates ``W · (sum of its token losses) / N_global``. Under
sequence parallelism a rank's tokens are its shard of its data-parallel group's rows (``model_inputs``): the
shards' targets partition the rows', so each target counts once in ``N_global`` and in the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from moeshard.data import Batch
from moeshard.fsdp_moe import num_items_for_global_mean
from moeshard.models.common import model_inputs
from moeshard.train.config import gradient_sync
from moeshard.train.run.build import Job


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
    unsharded float32 gradients meanwhile; ``auto`` picks it on one rank); the same gradients to float32 rounding.
    Where every unit keeps its gathered parameters from forward to backward (``Parallelized.keeps_gathered``), a
    deferred sync keeps them gathered between the micro-batches too: one gather per unit per step.
    ``train.expert_weight_grads``: the weight gradients of experts outside FSDP are formed at every micro-batch or,
    from factors kept meanwhile, once in the last backward; the optimizer does this by itself
    (``moeshard.fsdp_moe.ExpertGradOptions``, given at build), so the loop calls nothing for it.

    Args:
        before_update: called after backward and clipping, before the optimizer step (the loop's finiteness check
            reads the stats there; an exception leaves the parameters unchanged).
        stop_requested: this rank's vote to stop after this step, counted in ``StepStats.stop_votes``.
    """
    model, world, balancing = job.model, dist.get_world_size(), job.balancing
    lr = job.optimizer.param_groups[0]["lr"]
    job.optimizer.zero_grad(set_to_none=True)
    sp_rank, sp = job.meshes.sp_rank, job.meshes.sp_size
    inputs = [model_inputs(b, sp_rank=sp_rank, sp_size=sp) for b in micro_batches]  # this rank's shard of the rows
    local_tokens = sum(i.num_targets for i in inputs)  # CPU tensors: no sync
    # N_global / W on the device (no host sync): each rank's loss is W * sum_r / N_global, FSDP averages over W.
    num_items = num_items_for_global_mean(local_tokens).clamp_min(1.0 / world)
    lm_sum = torch.zeros((), device=job.device, dtype=torch.float32)
    balancing.start_step(len(micro_batches))
    last, defer_sync = len(micro_batches) - 1, gradient_sync(job.cfg.train, world) == "last_micro_batch"
    for m, b in enumerate(inputs):
        b = b.to(job.device, non_blocking=True)  # pinned by the loader on CUDA: an asynchronous copy
        out = model(
            # Packed rows: positions restart and attention stays inside each document (document_ids -1: padding);
            # attention_mask is None unless padded and keeps padding out of the router's aux loss too.
            **b.kwargs,
            num_items_in_batch=num_items,
            output_router_logits=True,
            return_logits=False,  # the loss goes through the head in chunks, never holding [tokens, vocab] logits
        )
        if defer_sync and m in (0, last):
            # Off from the first backward, on for the last: the earlier backwards add into FSDP's unsharded
            # gradients, the last one reduce-scatters their sum once (experts kept out of FSDP reduce nothing).
            model.set_requires_gradient_sync(m == last)
            if job.parallel.keeps_gathered:  # no peak memory of its own: all are gathered at forward's end anyway
                model.set_reshard_after_backward(m == last)
        term = balancing.micro_batch_loss(out, b.token_mask, rows=b.rows)  # rows: sequence scope
        (out.lm_loss + term).backward()
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
