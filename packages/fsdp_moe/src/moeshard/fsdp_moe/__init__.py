"""moeshard.fsdp_moe: expert-aware FSDP2 for MoE models with expert parallelism.

Experts are sharded on dim 0 by EP and on dim 1 by FSDP2 over ``ep_fsdp``; everything else on dim 0 over all
ranks. Gradients of both kinds equal single-process gradients of the global batch; AdamW, clipping and DCP
checkpoints work across the two meshes. Where ``ep_fsdp`` has one rank the experts stay out of FSDP and
:class:`LocalExpertAdamW` updates them in one fused pass, beside :class:`OnePassAdamW` (torch's AdamW with a
one-pass CUDA update) for the rest, in one :class:`OptimizersContainer`. Example (under torchrun)::

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import build_optimizer, num_items_for_global_mean, save_checkpoint, shard_model
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=8)
    ep_info = apply_ep(model, model.get_parallel_plan(), meshes.ep)
    units = shard_model(model, meshes, ep_info=ep_info)      # units.stages -> moeshard.prefetch
    model.to_empty(device="cuda"); load_weights(model)       # float32 weights, then the optimizer
    optim = build_optimizer(model, lr=3e-4, weight_decay=0.1)
    n = num_items_for_global_mean((labels[:, 1:] != -100).sum())
    model(input_ids, labels=labels, num_items_in_batch=n).loss.backward()
    optim.clip_grad_norm_(1.0)                               # one norm over both meshes; applied in the step
    optim.step(); optim.zero_grad()
    save_checkpoint("ckpt/step_100", model, optim)           # loads into any EP size / world size
"""

from moeshard.fsdp_moe._adamw_step import split_master
from moeshard.fsdp_moe._clip import clip_grad_norm_, get_total_norm
from moeshard.fsdp_moe._deferral import ExpertGradOptions, expert_grad_budget, kept_factor_ratio
from moeshard.fsdp_moe._loss import num_items_for_global_mean
from moeshard.fsdp_moe._optim import OptimizersContainer, build_optimizer
from moeshard.fsdp_moe._reduced_grad import (
    ReducedGrad,
    ReducedGradTarget,
    grouped_grad_accumulation,
    reduced_grad_target,
)
from moeshard.fsdp_moe._shard import FSDPUnits, Stage, default_mp_policy, shard_model
from moeshard.fsdp_moe._state_dict import (
    SplitMaster,
    get_state_dict,
    joined_masters,
    load_checkpoint,
    save_checkpoint,
    set_state_dict,
)

__all__ = [
    "ExpertGradOptions",
    "FSDPUnits",
    "OptimizersContainer",
    "ReducedGrad",
    "ReducedGradTarget",
    "SplitMaster",
    "Stage",
    "build_optimizer",
    "clip_grad_norm_",
    "default_mp_policy",
    "expert_grad_budget",
    "get_state_dict",
    "get_total_norm",
    "grouped_grad_accumulation",
    "joined_masters",
    "kept_factor_ratio",
    "load_checkpoint",
    "num_items_for_global_mean",
    "reduced_grad_target",
    "save_checkpoint",
    "set_state_dict",
    "shard_model",
    "split_master",
]
