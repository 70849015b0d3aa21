"""Measured communication per step (``logging.comm_accounting: true``): bytes by collective kind and process group.

While active, :class:`CommAccounting` wraps the collectives of ``torch.distributed`` (c10d: ``all_to_all_single``,
``all_gather_single`` / ``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``,
``all_reduce``, ``broadcast``, ...) and of the functional collectives DTensor uses, wherever a loaded ``torch`` or
``moeshard`` module holds them. FSDP2 calls ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` (torch
2.13; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before) through the ``torch.distributed`` module,
moeshard.ep calls ``dist.all_to_all_single``, clipping reduces DTensor norms through ``funcol.all_reduce``: all are
counted. A collective that calls another is counted once, as the outer one.

Convention (shared with the estimate of ``plan``, see :mod:`moeshard.train.comm`): the bytes a rank *sends to its
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
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moeshard.train.train import Callback, StepStats

# Function name -> kind, for torch.distributed (c10d) and the functional collectives (funcol).
_C10D = {
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "isend": "send",
    "barrier": "barrier",
}
_FUNCOL = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_single_autograd": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_autograd": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "broadcast": "broadcast",
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


class CommAccounting:
    """Count collective traffic per ``kind/group`` while active (a context manager); one instance at a time.

    Args:
        labels: process group -> name (e.g. ``{meshes.ep.get_group(): "ep", ...}``); others are named by ranks.
        ranks_per_node: to tell intra- from inter-node peers (global rank // ranks_per_node is the node).
    """

    def __init__(self, labels: dict[Any, str], ranks_per_node: int) -> None:
        # Groups this rank is not part of (``new_group`` gives them as a sentinel) are left out.
        self._labels = {self._key(g): name for g, name in labels.items() if hasattr(g, "group_name")}
        self._rpn = ranks_per_node
        self._groups: dict[str, _Group] = {}
        self._stats: dict[str, CommStat] = {}
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        self._paused = False

    @staticmethod
    def _key(group: Any) -> str:
        return str(group.group_name)

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

    # ---- patching ------------------------------------------------------------------------------------------
    def __enter__(self) -> CommAccounting:
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        replacements: dict[int, Any] = {}
        for module, table, resolve in ((c10d, _C10D, self._c10d_group), (funcol, _FUNCOL, self._funcol_group)):
            for name, kind in table.items():
                original = getattr(module, name, None)
                if original is None:
                    continue  # not in this torch version
                replacements[id(original)] = self._wrap(original, kind, resolve)
        # Every loaded torch/moeshard module that holds one of the originals (``dist.x``, ``from ... import x``).
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(("torch", "moeshard")):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and id(value) in replacements:
                    self._patched.append((mod, attr, value))
                    setattr(mod, attr, replacements[id(value)])
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, attr, original in reversed(self._patched):
            setattr(mod, attr, original)
        self._patched = []

    def _wrap(self, fn: Callable[..., Any], kind: str, resolve: Callable[[Any], Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0 and not self._paused:
                try:
                    self._count(kind, signature.bind(*args, **kwargs).arguments, resolve)
                except Exception:  # noqa: BLE001 - accounting must never break the collective itself
                    pass
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    # ---- groups --------------------------------------------------------------------------------------------
    @staticmethod
    def _c10d_group(group: Any) -> Any:
        if group is None:
            return dist.distributed_c10d._get_default_group()
        if isinstance(group, str):
            return dist.distributed_c10d._resolve_process_group(group)
        return group

    @staticmethod
    def _funcol_group(group: Any) -> Any:
        import torch.distributed._functional_collectives as funcol

        name = funcol._resolve_group_name(group)
        return dist.distributed_c10d._resolve_process_group(name)

    def _group(self, pg: Any) -> _Group:
        key = self._key(pg)
        if key not in self._groups:
            ranks = dist.get_process_group_ranks(pg)
            label = self._labels.get(key)
            if label is None:
                label = "world" if len(ranks) == dist.get_world_size() else "group" + str(ranks).replace(" ", "")
            nodes = [r // self._rpn for r in ranks]
            self._groups[key] = _Group(label, ranks, ranks.index(dist.get_rank()), nodes)
        return self._groups[key]

    # ---- bytes ---------------------------------------------------------------------------------------------
    def _count(self, kind: str, a: dict[str, Any], resolve: Callable[[Any], Any]) -> None:
        g = self._group(resolve(a.get("group")))
        n, me = len(g.ranks), g.index
        per_peer = [0.0] * n  # bytes sent to each member of the group
        tensor = a.get("input", a.get("input_tensor", a.get("self", a.get("tensor"))))
        if kind == "all_to_all":
            if "input_tensor_list" in a:
                per_peer = [float(_nbytes(t)) for t in a["input_tensor_list"]]
            else:
                splits = a.get("input_split_sizes")
                rows = tensor.shape[0] if tensor.dim() else 1
                row_bytes = _nbytes(tensor) / max(rows, 1)
                per_peer = [row_bytes * s for s in splits] if splits else [_nbytes(tensor) / n] * n
        elif kind == "all_gather":
            if "tensor_list" in a and "tensor" in a:  # all_gather(tensor_list, tensor)
                tensor = a["tensor"]
            per_peer = [float(_nbytes(tensor))] * n
        elif kind == "reduce_scatter":
            if "input_list" in a:
                per_peer = [float(_nbytes(t)) for t in a["input_list"]]
            else:
                per_peer = [_nbytes(tensor) / n] * n
        elif kind == "all_reduce":
            tensors = a.get("tensors", tensor)
            per_peer = [2.0 * _nbytes(tensors) / n] * n
        elif kind == "broadcast" and a.get("src", 0) == dist.get_rank():
            per_peer = [float(_nbytes(tensor))] * n
        elif kind == "scatter" and a.get("src", 0) == dist.get_rank():
            per_peer = [float(_nbytes(t)) for t in a.get("scatter_list") or [tensor] * n]
        elif kind in ("reduce", "gather", "send"):
            dst = a.get("dst")
            if dst is None and a.get("group_dst") is not None:  # batch_isend_irecv passes the group rank
                dst = g.ranks[a["group_dst"]]
            dst = 0 if dst is None else dst
            if dst in g.ranks and g.ranks.index(dst) != me:
                per_peer[g.ranks.index(dst)] = float(_nbytes(tensor))
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
