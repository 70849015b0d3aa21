"""The next forward's first all-gathers, issued as the optimizer step ends.

A step starts with the all-gathers of its first stages (the embedding's and the first layer's: ~4 ms on 2 H200s
at the 8-layer benchmark) while the device has nothing else to do. Issued from an optimizer step post-hook, after
the step has updated the sharded parameters they read, they overlap what follows in the step: the post-hooks
registered after this one (``moeshard.fsdp_moe.fuse_local_expert_updates``' expert update, ~17 ms of
memory-bound kernels at the benchmark) and the host's work between steps.

A prefetched copy is the sharded parameters as the step left them. If any of them changes before the unit's
next forward (a checkpoint load, an in-place edit, DCP's optimizer-state initialisation), the copy is dropped
(waited for, then resharded) before FSDP2's pre-forward, which then gathers afresh: the forward always sees
the current parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeshard.prefetch._schedule import PrefetchSchedule

__all__ = ["StepEndPrefetch", "prefetch_next_forward_at_step"]


def _sharded_params(module: nn.Module) -> list[torch.Tensor]:
    """The sharded parameters the module's own FSDP unit gathers (all its parameters if that is not visible)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
    params = [fp.sharded_param for g in groups if g is not None for fp in getattr(g, "fsdp_params", ())]
    return params or list(module.parameters())


def _versions(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    # in-place changes through a DTensor count on its own version counter, changes to its local tensor on that one
    return [(p._version, getattr(p, "_local_tensor", p)._version) for p in params]


class StepEndPrefetch:
    """The installed hooks of :func:`prefetch_next_forward_at_step`; ``remove()`` takes them out."""

    def __init__(self, schedule: PrefetchSchedule, optimizer: torch.optim.Optimizer):
        first = schedule.stages[0]
        names = [first.unit, *[u for u in first.forward if u != first.unit]]
        self.targets = [schedule.module(u) for u in names]
        self.pending: dict[int, tuple[Any, list[torch.Tensor], list[tuple[int, int]]]] = {}
        self.issued = self.dropped = 0
        self._handles = [optimizer.register_step_post_hook(self._issue)]
        for m in self.targets:  # before FSDP2's own pre-forward hook (registered by fully_shard, also prepended)
            self._handles.append(m.register_forward_pre_hook(self._check, prepend=True))

    def _issue(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for m in self.targets:
            if id(m) in self.pending:
                continue
            params = _sharded_params(m)
            versions = _versions(params)
            handle = m.unshard(async_op=True)
            self.pending[id(m)] = (handle, params, versions)
            self.issued += 1

    def _check(self, module: nn.Module, args: Any) -> None:
        entry = self.pending.pop(id(module), None)
        if entry is None:
            return
        handle, params, versions = entry
        if _versions(params) != versions:  # changed since the gather: drop the stale copy, FSDP gathers anew
            if handle is not None:
                handle.wait()
            module.reshard()
            self.dropped += 1

    def remove(self) -> None:
        """Remove the hooks (a pending prefetch is still consumed by the next forward)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def prefetch_next_forward_at_step(schedule: PrefetchSchedule, optimizer: torch.optim.Optimizer) -> StepEndPrefetch:
    """All-gather the first stage's unit and its forward prefetch targets at the end of each ``optimizer.step()``.

    Register it before other step post-hooks whose work it should overlap (it runs in registration order), e.g.
    before ``moeshard.fsdp_moe.fuse_local_expert_updates``. Apply the schedule first (:func:`apply_schedule`).

    Example::

        apply_schedule(schedule)
        optim = torch.optim.AdamW(model.parameters(), fused=True)
        prefetch_next_forward_at_step(schedule, optim)
        fuse_local_expert_updates(model, optim)

    Returns:
        The installed hooks (``issued`` / ``dropped`` count the prefetches and the stale ones dropped).
    """
    if not schedule.stages:
        raise ValueError("the schedule has no stages: there is nothing to prefetch")
    return StepEndPrefetch(schedule, optimizer)
