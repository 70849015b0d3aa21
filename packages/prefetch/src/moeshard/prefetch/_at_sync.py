"""Issuing a schedule's forward prefetches at a host sync instead of in each stage's pre-forward.

With expert parallelism every MoE layer makes one device→host sync (the all-to-all split sizes). The host then
waits for the device to drain, and after it the device waits for the host to launch work again. FSDP2 issues a
stage's forward prefetch (the next layer's all-gather: a cast, a copy-in and the collective, host work of its own
every layer) from the stage's pre-forward hook, right when the device is waiting for the layer's first kernels.
Issued just before the layer's sync instead, the same host work overlaps device work it would otherwise delay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from moeshard.prefetch._record import _in_backward
from moeshard.prefetch._schedule import PrefetchSchedule

__all__ = ["HostSyncPrefetch", "prefetch_forward_at_host_sync"]


class HostSyncPrefetch:
    """The installed hooks of :func:`prefetch_forward_at_host_sync`; ``remove()`` restores the schedule."""

    def __init__(self, schedule: PrefetchSchedule, register_host_sync_hook: Callable[[Callable[[], None]], Any]):
        self.schedule = schedule
        self.pending: list[nn.Module] = []
        self._handles: list[Any] = []
        for stage in schedule.stages:
            owner = schedule.module(stage.unit)
            targets = [schedule.module(u) for u in stage.forward]
            owner.set_modules_to_forward_prefetch([])
            self._handles.append(owner.register_forward_pre_hook(functools.partial(self._begin, targets)))
            self._handles.append(owner.register_forward_hook(self._end))
        self._handles.append(register_host_sync_hook(self.issue))

    def _begin(self, targets: list[nn.Module], module: nn.Module, args: Any) -> None:
        if _in_backward():  # a recomputation under activation checkpointing: backward prefetch applies
            return
        self.issue()
        self.pending = list(targets)

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.issue()  # a stage without a sync (e.g. the embedding) prefetches when it ends

    def issue(self) -> None:
        """All-gather the current stage's pending prefetch targets now (asynchronously); FSDP2 waits for them in
        their own pre-forward."""
        if _in_backward():
            return
        pending, self.pending = self.pending, []
        for module in pending:
            module.unshard(async_op=True)

    def remove(self) -> None:
        """Remove the hooks and give the stages their pre-forward prefetch lists back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for stage in self.schedule.stages:
            self.schedule.module(stage.unit).set_modules_to_forward_prefetch(
                [self.schedule.module(u) for u in stage.forward]
            )


def prefetch_forward_at_host_sync(
    schedule: PrefetchSchedule, register_host_sync_hook: Callable[[Callable[[], None]], Any]
) -> HostSyncPrefetch:
    """Issue each stage's forward prefetches at the first host sync inside the stage (or when it ends).

    Apply the schedule first (:func:`apply_schedule`); backward prefetching is left as it is. Which units are
    prefetched, and how far ahead, does not change; only the moment the host issues them does.

    Example (the EP split-size syncs of the dispatchers ``apply_ep`` installed)::

        ep_info = apply_ep(model, plan, meshes.ep)
        ...
        apply_schedule(schedule)
        prefetch_forward_at_host_sync(schedule, ep_info.add_host_sync_hook)

    Args:
        schedule: the applied schedule.
        register_host_sync_hook: registers a no-argument callable to run right before each host sync and returns a
            handle with ``remove()`` (``EPInfo.add_host_sync_hook`` of ``moeshard.ep.apply_ep``'s result for the EP
            split-size syncs).

    Returns:
        The installed hooks; ``remove()`` restores pre-forward prefetching.
    """
    if not schedule.enabled:
        raise ValueError("the schedule prefetches nothing (depth 0): there is nothing to move to the host sync")
    return HostSyncPrefetch(schedule, register_host_sync_hook)
