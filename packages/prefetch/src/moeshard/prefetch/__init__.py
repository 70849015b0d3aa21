"""moeshard.prefetch: forward/backward prefetch schedules over nested FSDP2 units (layer and expert units).

Example (after ``moeshard.fsdp_moe.shard_model``)::

    from moeshard.prefetch import apply_schedule, build_schedule, record_unshard_order, stage_units

    units = shard_model(model, meshes, ep_info=apply_ep(model, model.get_parallel_plan(), meshes.ep))
    schedule = build_schedule(units.stages, depth=1)   # layer i prefetches layer i+1 (fwd) / i-1 (bwd)
    apply_schedule(schedule)
    print(schedule.describe())
    with record_unshard_order(stage_units(units.stages)) as trace:   # evidence: the all-gather order
        model(input_ids, labels=labels).loss.backward()
    print(trace.describe())
"""

from moeshard.prefetch._at_sync import HostSyncPrefetch, prefetch_forward_at_host_sync
from moeshard.prefetch._overlap import CommOverlap, analyze_comm_overlap
from moeshard.prefetch._record import TraceEvent, UnshardTrace, record_unshard_order
from moeshard.prefetch._schedule import (
    PrefetchSchedule,
    StageLike,
    StagePrefetch,
    apply_schedule,
    build_schedule,
    stage_units,
)

__all__ = [
    "CommOverlap",
    "HostSyncPrefetch",
    "PrefetchSchedule",
    "StageLike",
    "StagePrefetch",
    "TraceEvent",
    "UnshardTrace",
    "analyze_comm_overlap",
    "prefetch_forward_at_host_sync",
    "apply_schedule",
    "build_schedule",
    "record_unshard_order",
    "stage_units",
]
