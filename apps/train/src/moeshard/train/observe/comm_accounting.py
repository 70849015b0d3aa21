"""Measured communication per step (``logging.comm_accounting: true``): bytes by collective kind and process group.

While active, :class:`CommAccounting` is a ``TorchDispatchMode``: every collective reaches the dispatcher as a
c10d op (``c10d.allreduce_``, ``c10d._allgather_base_``, ``c10d.alltoall_base_``, ``c10d.send``, ... for
``torch.distributed``'s calls: FSDP2's all-gathers and reduce-scatters, moeshard.ep's exchanges) or a functional
collective (``_c10d_functional.all_reduce``, ... for DTensor: the clipping's norms), and the mode counts it there
from the op's own arguments. No function of any loaded module is replaced. Each collective is one op, so it is
counted once. Every other op passes through the mode too (a Python call per op): with accounting on, the step is
slower; count bytes with it, time steps without it.

Convention (shared with the estimate of ``plan``, see :mod:`moeshard.train.observe.comm`): the bytes a rank *sends to its
peers*, per peer, so a peer on another node makes them inter-node bytes:

- all-gather: its input to every peer, ``(n-1)·s``; reduce-scatter: each peer's chunk, ``(n-1)/n·S``;
- all-to-all: the rows it sends to each peer (its own rows stay local);
- all-reduce: ``2·(n-1)/n·S`` (a reduce-scatter plus an all-gather); broadcast: ``S`` to every peer from the source.

Each key is ``"<kind>/<group>"`` with the group named after the mesh axis (``ep``, ``ep_fsdp``, ``fsdp``,
``world``) or, otherwise, its ranks. :class:`CommPerStep` is the training loop's callback: it counts each step and
puts the mean per rank into the step's stats (``extra["comm"]``) for the metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moeshard.train._torch_internals import TorchDispatchMode, op_argument_names, resolve_process_group
from moeshard.train.run import Callback, StepStats

# Op name (c10d and _c10d_functional) -> kind. Ops not listed (barrier, wait_tensor, ...) move no data to count.
_OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    "send": "send",
}


@dataclass
class CommStat:
    """Totals of one ``kind/group`` key on one rank."""

    calls: int = 0
    bytes: float = 0.0
    inter_node_bytes: float = 0.0
    max_call_bytes: float = 0.0

    def add(self, total: float, inter: float) -> None:
        """Count one collective that sent ``total`` bytes, ``inter`` of them to other nodes."""
        self.calls += 1
        self.bytes += total
        self.inter_node_bytes += inter
        self.max_call_bytes = max(self.max_call_bytes, total)


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


@dataclass
class _Group:
    label: str
    ranks: list[int]
    index: int  # this rank's position in ``ranks``
    peers_node: list[int] = field(default_factory=list)  # node of each member


class CommAccounting(TorchDispatchMode):
    """Count collective traffic per ``kind/group`` while active (a ``TorchDispatchMode``: ``with`` it, or enter it
    and exit it on the same thread).

    Args:
        labels: process group -> name (e.g. ``{meshes.ep.get_group(): "ep", ...}``); others are named by ranks.
        ranks_per_node: to tell intra- from inter-node peers (global rank // ranks_per_node is the node).
    """

    def __init__(self, labels: dict[Any, str], ranks_per_node: int) -> None:
        super().__init__()
        # Groups this rank is not part of (``new_group`` gives them as a sentinel) are left out.
        self._labels = {str(g.group_name): name for g, name in labels.items() if hasattr(g, "group_name")}
        self._rpn = ranks_per_node
        self._groups: dict[str, _Group] = {}
        self._stats: dict[str, CommStat] = {}
        self._paused = False

    # ---- results -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the counts (call at the start of each step)."""
        self._stats = {}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """This rank's counts since the last reset: ``{"kind/group": {"calls", "bytes", "inter_node_bytes",
        "max_call_bytes"}}``."""
        return {k: dict(vars(v)) for k, v in sorted(self._stats.items())}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not counted (e.g. gathering the counts themselves)."""
        self._paused, before = True, self._paused
        try:
            yield
        finally:
            self._paused = before

    # ---- the mode ------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _OPS.get(func._opname) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind is not None and not self._paused:
            named = dict(zip(op_argument_names(func), args)) | kwargs
            try:
                self._count(kind, named)
            except Exception:  # noqa: BLE001 - accounting must never break the collective itself
                pass
        return func(*args, **kwargs)

    # ---- groups --------------------------------------------------------------------------------------------
    def _group(self, a: dict[str, Any]) -> _Group:
        if "process_group" in a:  # c10d ops: the ProcessGroup as a script object
            pg = dist.ProcessGroup.unbox(a["process_group"])
        else:  # functional collectives: the group's name
            pg = resolve_process_group(a["group_name"])
        key = str(pg.group_name)
        if key not in self._groups:
            ranks = dist.get_process_group_ranks(pg)
            label = self._labels.get(key)
            if label is None:
                label = "world" if len(ranks) == dist.get_world_size() else "group" + str(ranks).replace(" ", "")
            nodes = [r // self._rpn for r in ranks]
            self._groups[key] = _Group(label, ranks, ranks.index(dist.get_rank()), nodes)
        return self._groups[key]

    # ---- bytes ---------------------------------------------------------------------------------------------
    def _count(self, kind: str, a: dict[str, Any]) -> None:
        g = self._group(a)
        n, me = len(g.ranks), g.index
        per_peer = [0.0] * n  # bytes sent to each member of the group
        tensor = next((a[k] for k in ("input", "inputs", "input_tensor", "tensors", "input_tensors") if k in a), None)
        if kind == "all_to_all":
            if isinstance(tensor, (list, tuple)):  # alltoall_: one input tensor per peer
                per_peer = [float(_nbytes(t)) for t in tensor]
            else:
                splits = a.get("input_split_sizes")
                rows = tensor.shape[0] if tensor.dim() else 1
                row_bytes = _nbytes(tensor) / max(rows, 1)
                per_peer = [row_bytes * s for s in splits] if splits else [_nbytes(tensor) / n] * n
        elif kind == "all_gather":
            per_peer = [float(_nbytes(tensor))] * n
        elif kind == "reduce_scatter":
            if a.get("input_tensors") is not None and "output_tensors" in a and isinstance(tensor[0], list):
                per_peer = [float(_nbytes(t)) for t in tensor[0]]  # reduce_scatter_: a list of per-peer inputs
            else:
                per_peer = [_nbytes(tensor) / n] * n
        elif kind == "all_reduce":
            per_peer = [2.0 * _nbytes(tensor) / n] * n
        elif kind == "broadcast" and (a["root_rank"] == me if "root_rank" in a else a.get("src") == g.ranks[me]):
            per_peer = [float(_nbytes(tensor))] * n
        elif kind == "scatter" and a.get("root_rank", 0) == me:
            per_peer = [float(_nbytes(t)) for t in (a.get("input_tensors") or [[]])[0]] or per_peer
        elif kind in ("reduce", "gather", "send"):
            dst = a.get("dstRank", a.get("root_rank", 0))  # a rank of the group
            if 0 <= dst < n and dst != me:
                per_peer[dst] = float(_nbytes(tensor))
        per_peer[me] = 0.0  # what stays on this rank is not communication
        my_node = g.peers_node[me]
        total = sum(per_peer)
        inter = sum(b for b, node in zip(per_peer, g.peers_node) if node != my_node)
        self._stats.setdefault(f"{kind}/{g.label}", CommStat()).add(total, inter)


def merge_ranks(per_rank: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-rank snapshots -> the mean per rank of ``calls``, ``bytes``, ``inter_node_bytes`` and the max of
    ``max_call_bytes`` (the figures written to ``metrics.jsonl`` under ``"comm"``)."""
    keys = sorted({k for snap in per_rank for k in snap})
    n = len(per_rank)
    out = {}
    for k in keys:
        rows = [snap.get(k, {}) for snap in per_rank]
        out[k] = {
            "calls": sum(r.get("calls", 0) for r in rows) / n,
            "bytes": sum(r.get("bytes", 0.0) for r in rows) / n,
            "inter_node_bytes": sum(r.get("inter_node_bytes", 0.0) for r in rows) / n,
            "max_call_bytes": max(r.get("max_call_bytes", 0.0) for r in rows),
        }
    return out


class CommPerStep(Callback):
    """Counts every step's collectives (all ranks take part) and puts :func:`merge_ranks` of them into
    ``stats.extra["comm"]`` after the step.

    Args:
        meshes: the job's ``ParallelMeshes`` (groups named ``ep``, ``ep_fsdp``, ``fsdp``).
        ranks_per_node: to tell intra- from inter-node peers.
    """

    def __init__(self, meshes: Any, ranks_per_node: int) -> None:
        labels = {meshes.ep.get_group(): "ep", meshes.ep_fsdp.get_group(): "ep_fsdp", meshes.fsdp.get_group(): "fsdp"}
        self.accounting = CommAccounting(labels, ranks_per_node)

    def on_run_start(self) -> None:
        self.accounting.__enter__()

    def on_step_start(self, step: int) -> None:
        self.accounting.reset()

    def on_step_end(self, step: int, stats: StepStats) -> None:
        snapshot = self.accounting.snapshot()
        with self.accounting.paused():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, snapshot)
        stats.extra["comm"] = merge_ranks(gathered)

    def on_run_end(self) -> None:
        self.accounting.__exit__(None, None, None)
