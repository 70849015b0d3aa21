"""How much all-gather time a GPU step leaves exposed, from a ``torch.profiler`` Chrome trace.

Exposed all-gather time = the time some all-gather kernel runs while no kernel runs on the compute stream: the
length of (union of all-gather kernel intervals) minus its overlap with (union of compute-stream kernel
intervals). The compute stream is the stream with the most non-NCCL kernel time (PyTorch's current stream for
the model); NCCL kernels are recognised by name (``ncclDevKernel_AllGather_RING_LL``, ``ncclKernel_AllGather_*``).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CommOverlap", "analyze_comm_overlap"]

Interval = tuple[float, float]


@dataclass(frozen=True)
class CommOverlap:
    """Kernel time in a profiled window, in seconds (divide by the number of profiled steps for per-step values).

    Attributes:
        window_s: from the first kernel's start to the last kernel's end.
        compute_s: busy time of the compute stream's non-NCCL kernels.
        all_gather_s: busy time of all-gather kernels (union over streams).
        exposed_all_gather_s: all-gather busy time during which the compute stream is idle.
        comm_s: busy time of every NCCL kernel (all-gather, reduce-scatter, all-to-all, ...).
        exposed_comm_s: NCCL busy time during which the compute stream is idle.
        compute_stream: the stream id taken as the compute stream (None without kernels).
        num_all_gather_kernels: all-gather kernels seen.
        num_kernels: kernels seen.
    """

    window_s: float
    compute_s: float
    all_gather_s: float
    exposed_all_gather_s: float
    comm_s: float
    exposed_comm_s: float
    compute_stream: int | None
    num_all_gather_kernels: int
    num_kernels: int

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return asdict(self)


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(merged: list[Interval]) -> float:
    return sum(end - start for start, end in merged)


def _overlap(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two merged (sorted, disjoint) interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _stream(event: Mapping[str, Any]) -> int:
    return int(event.get("args", {}).get("stream", event.get("tid", -1)))


def _is_all_gather(name: str) -> bool:
    return "allgather" in name.lower().replace("_", "")


def analyze_comm_overlap(trace: str | os.PathLike[str] | Mapping[str, Any]) -> CommOverlap:
    """Measure compute, all-gather and exposed all-gather time in a profiler trace.

    Args:
        trace: a Chrome trace written by ``prof.export_chrome_trace(path)`` (its path, or the loaded JSON).

    Returns:
        The totals over the whole trace.
    """
    if not isinstance(trace, Mapping):
        with open(trace) as f:
            trace = json.load(f)
    kernels = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel" and "dur" in e
    ]
    busy: dict[int, float] = defaultdict(float)
    for e in kernels:
        if "nccl" not in e.get("name", "").lower():
            busy[_stream(e)] += float(e["dur"])
    compute_stream = max(busy, key=busy.__getitem__) if busy else None

    def span(e: Mapping[str, Any]) -> Interval:
        start = float(e["ts"]) * 1e-6  # Chrome traces are in microseconds
        return start, start + float(e["dur"]) * 1e-6

    compute, gathers, comm = [], [], []
    for e in kernels:
        name = e.get("name", "")
        if "nccl" in name.lower():
            comm.append(span(e))
            if _is_all_gather(name):
                gathers.append(span(e))
        elif _stream(e) == compute_stream:
            compute.append(span(e))
    compute_m, gathers_m, comm_m = _merge(compute), _merge(gathers), _merge(comm)
    spans = [span(e) for e in kernels]
    return CommOverlap(
        window_s=(max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
        compute_s=_length(compute_m),
        all_gather_s=_length(gathers_m),
        exposed_all_gather_s=_length(gathers_m) - _overlap(gathers_m, compute_m),
        comm_s=_length(comm_m),
        exposed_comm_s=_length(comm_m) - _overlap(comm_m, compute_m),
        compute_stream=compute_stream,
        num_all_gather_kernels=len(gathers),
        num_kernels=len(kernels),
    )
