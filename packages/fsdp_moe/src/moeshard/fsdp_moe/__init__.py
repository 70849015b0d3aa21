"""moeshard.fsdp_moe: expert-aware FSDP2 for MoE models with expert parallelism.

Experts are sharded on dim 0 by EP and on dim 1 by FSDP2 over ``ep_fsdp``; everything else on dim 0 over all
ranks. Gradients of both kinds equal single-process gradients of the global batch; clipping, AdamW and DCP
checkpoints work across the two meshes. Example (under torchrun)::

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import clip_grad_norm_, num_items_for_global_mean, save_checkpoint, shard_model
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=8)
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    units = shard_model(model, meshes)                       # units.stages -> moeshard.prefetch
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    fuse_local_expert_updates(model, optim)                  # optional: one pass per step for experts outside FSDP
    n = num_items_for_global_mean((labels[:, 1:] != -100).sum())
    model(input_ids, labels=labels, num_items_in_batch=n).loss.backward()
    clip_grad_norm_(model, 1.0, optimizer=optim)             # fused: the clip is applied inside optim.step()
    optim.step(); optim.zero_grad()
    save_checkpoint("ckpt/step_100", model, optim)           # loads into any EP size / world size
"""

from moeshard.fsdp_moe._clip import clip_grad_norm_, get_total_norm
from moeshard.fsdp_moe._fused_update import fuse_local_expert_updates
from moeshard.fsdp_moe._local_experts import expert_grad
from moeshard.fsdp_moe._loss import num_items_for_global_mean
from moeshard.fsdp_moe._shard import (
    FSDPUnits,
    ShardingInfo,
    Stage,
    default_mp_policy,
    get_sharding_info,
    shard_model,
)
from moeshard.fsdp_moe._state_dict import get_state_dict, load_checkpoint, save_checkpoint, set_state_dict

__all__ = [
    "FSDPUnits",
    "ShardingInfo",
    "Stage",
    "clip_grad_norm_",
    "default_mp_policy",
    "expert_grad",
    "fuse_local_expert_updates",
    "get_sharding_info",
    "get_state_dict",
    "get_total_norm",
    "load_checkpoint",
    "num_items_for_global_mean",
    "save_checkpoint",
    "set_state_dict",
    "shard_model",
]
