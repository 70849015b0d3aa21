"""The layout-independent DCP state of a model sharded by ``moeshard.fsdp_moe`` and its optimizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from moeshard.checkpoint._resume import load_checkpoint


def model_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, masters: str = "joined"
) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` of a model sharded by ``moeshard.fsdp_moe.shard_model`` (experts in
    their global shape), ready for :func:`save_checkpoint`: a checkpoint written under one EP size / world size
    loads under any other. The tensors alias the live ones (nothing is copied), except the float32 masters a
    ``LocalExpertAdamW`` holds split (a bf16 compute dtype): ``masters="joined"`` joins them into new tensors
    while the dict lives (4 bytes per expert parameter on the device; what a load into the dict needs);
    ``masters="split"`` leaves a ``moeshard.fsdp_moe.SplitMaster`` in their place, which :func:`save_checkpoint`
    and :func:`start_async_save` stage one at a time through the :class:`Stager` (on CUDA, one joined master on the
    device at a time; without a stager on CUDA, all at once before the write).

    ``optimizer``: a torch optimizer, a ``LocalExpertAdamW`` or an ``OptimizersContainer`` (see
    ``moeshard.fsdp_moe.get_state_dict``). Call it once the optimizer has stepped (or loaded a state): before that,
    torch's ``get_optimizer_state_dict`` makes the state by a step of its own (lr 0, but the step count moves).
    """
    from moeshard.fsdp_moe import get_state_dict

    return get_state_dict(model, optimizer, masters=masters)


def load_model_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Load a checkpoint of any layout into the model and optimizer (every rank calls it).

    Returns:
        ``(extra, this rank's rank_state or None)`` as :func:`load_checkpoint`.
    """
    from moeshard.fsdp_moe import set_state_dict

    state = model_state(model, optimizer)
    extra, rank_state = load_checkpoint(Path(path), state)
    set_state_dict(model, state, optimizer)
    return extra, rank_state
