"""Recording, during a real step, the order in which FSDP2 units are all-gathered and run.

The recorder wraps, per FSDP parameter group of each unit, the three methods through which FSDP2 moves a unit:
``unshard`` (every all-gather goes through it: the unit's own pre-forward/pre-backward and every explicit or
default prefetch), ``pre_backward`` and ``post_backward``; forward begin/end come from ordinary module hooks
placed around FSDP2's own. Those methods and their names are the same in torch 2.4-2.13; torch 2.13 may give a
unit several parameter groups (``_fsdp_param_groups``), older releases one (``_fsdp_param_group``). The
wrappers are instance attributes, removed on exit, so nothing outside the recorded units is touched.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from moeshard.prefetch._torch_internals import all_gather_result, fsdp_param_groups, in_backward

__all__ = ["TraceEvent", "UnshardTrace", "record_unshard_order"]

EVENT_KINDS = ("unshard", "forward_begin", "forward_end", "backward_begin", "backward_end")
_MISSING = object()


@dataclass(frozen=True)
class TraceEvent:
    """One recorded event.

    Attributes:
        kind: ``"unshard"`` (an all-gather was issued), ``"forward_begin"``, ``"forward_end"``,
            ``"backward_begin"`` (the unit's pre-backward) or ``"backward_end"`` (its post-backward).
        unit: the unit's name.
        phase: ``"forward"``, or ``"backward"`` when it happened inside the autograd engine.
        prefetch: for ``unshard``, whether it was issued outside the unit's own forward/backward (by another
            unit's hook); False for the other kinds.
        group: index of the unit's FSDP parameter group (0 unless a unit has several).
        time_s: seconds since recording began.
    """

    kind: str
    unit: str
    phase: str
    prefetch: bool
    group: int
    time_s: float


class UnshardTrace:
    """The events recorded by :func:`record_unshard_order`, in the order they happened."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self._t0 = time.perf_counter()
        self._in_forward: set[str] = set()
        self._backward_pending: dict[str, int] = {}  # unit -> parameter groups whose post-backward is still due

    def unshards(self, phase: str | None = None) -> list[str]:
        """Unit names in the order their all-gathers were issued (one entry per parameter group)."""
        return [e.unit for e in self.events if e.kind == "unshard" and phase in (None, e.phase)]

    def index(self, kind: str, unit: str, phase: str | None = None, nth: int = 0) -> int:
        """Position in :attr:`events` of the ``nth`` event of ``kind`` for ``unit`` (in ``phase`` if given).

        Raises:
            ValueError: an unknown kind, or no such event was recorded.
        """
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}; kinds: {EVENT_KINDS}")
        hits = [i for i, e in enumerate(self.events) if e.kind == kind and e.unit == unit and phase in (None, e.phase)]
        if nth >= len(hits):
            where = f" in {phase}" if phase else ""
            raise ValueError(f"{len(hits)} {kind} event(s) recorded for {unit!r}{where}, asked for #{nth}")
        return hits[nth]

    def as_list(self) -> list[dict[str, Any]]:
        """The events as plain dicts (JSON-ready)."""
        return [asdict(e) for e in self.events]

    def describe(self) -> str:
        """One line per event; ``unshard*`` marks a prefetch."""
        lines = []
        for i, e in enumerate(self.events):
            kind = e.kind + ("*" if e.prefetch else "")
            group = f" (group {e.group})" if e.group else ""
            lines.append(f"{i:4d}  {e.time_s * 1e3:9.3f} ms  {e.phase:<8}  {kind:<14}  {e.unit}{group}")
        return "\n".join(lines)

    # Recording (called from the hooks and wrappers).
    def _add(self, kind: str, unit: str, *, prefetch: bool = False, group: int = 0, t: float | None = None) -> None:
        t = time.perf_counter() if t is None else t
        phase = "backward" if in_backward() else "forward"
        self.events.append(TraceEvent(kind, unit, phase, prefetch, group, t - self._t0))

    def _forward_begin(self, unit: str, module: nn.Module, args: Any) -> None:
        self._in_forward.add(unit)
        self._add("forward_begin", unit)

    def _forward_end(self, unit: str, module: nn.Module, args: Any, output: Any) -> None:
        self._in_forward.discard(unit)
        self._add("forward_end", unit)

    def _unshard_issued(self, unit: str, group: int, t: float) -> None:
        own = unit in self._backward_pending if in_backward() else unit in self._in_forward
        self._add("unshard", unit, prefetch=not own, group=group, t=t)

    def _backward_begin(self, unit: str, num_groups: int) -> None:
        if unit not in self._backward_pending:  # FSDP2 calls pre-backward once per output tensor
            self._backward_pending[unit] = num_groups
            self._add("backward_begin", unit)

    def _backward_end(self, unit: str) -> None:
        if unit not in self._backward_pending:  # post-backward of a unit whose backward never began
            return
        self._backward_pending[unit] -= 1
        if self._backward_pending[unit] == 0:
            del self._backward_pending[unit]
            self._add("backward_end", unit)


def _pending_all_gather(group: Any) -> Any:
    """The group's pending all-gather, or ``_MISSING`` where the installed torch no longer keeps one where we read
    it (every ``unshard`` call is then recorded as issued: a coarser trace, not a failed step)."""
    try:
        return all_gather_result(group)
    except RuntimeError:
        return _MISSING


def _patch(obj: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Shadow ``obj.attr`` by an instance attribute wrapping it; return the undo."""
    had_own = attr in vars(obj)
    own = vars(obj).get(attr)
    setattr(obj, attr, make(getattr(obj, attr)))

    def undo() -> None:
        if had_own:
            setattr(obj, attr, own)
        else:
            delattr(obj, attr)

    return undo


def _wrap_unshard(trace: UnshardTrace, unit: str, index: int, group: Any):
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def unshard(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            before = _pending_all_gather(group)
            out = orig(*args, **kwargs)
            after = _pending_all_gather(group)
            # unshard() returns early when the unit is already gathered or its all-gather is in flight; only a
            # call that leaves a new pending result issued one. Without that attribute, record every call.
            if before is _MISSING or after is _MISSING or (before is None and after is not None):
                trace._unshard_issued(unit, index, t)
            return out

        return unshard

    return make


def _wrap_pre_backward(trace: UnshardTrace, unit: str, num_groups: int):
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def pre_backward(*args: Any, **kwargs: Any) -> Any:
            trace._backward_begin(unit, num_groups)
            return orig(*args, **kwargs)

        return pre_backward

    return make


def _wrap_post_backward(trace: UnshardTrace, unit: str):
    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def post_backward(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            trace._backward_end(unit)
            return out

        return post_backward

    return make


@contextlib.contextmanager
def record_unshard_order(
    units: Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]],
) -> Iterator[UnshardTrace]:
    """Record all-gathers and forward/backward begin/end of FSDP units while the block runs.

    Example::

        with record_unshard_order(stage_units(fsdp_units.stages)) as trace:
            model(batch).loss.backward()
        print(trace.describe())
        assert trace.index("unshard", "layers.1", "forward") < trace.index("forward_end", "layers.0")

    Args:
        units: ``name -> FSDPModule`` (a mapping or ``(name, module)`` pairs, e.g. :func:`stage_units`).

    Yields:
        The :class:`UnshardTrace` that fills while the block runs.

    Raises:
        ValueError: a module is not an ``FSDPModule``, or a name is used twice.
    """
    pairs = list(units.items()) if isinstance(units, Mapping) else list(units)
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"unit names must be unique, got {names}")
    for name, module in pairs:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"unit {name!r} is a {type(module).__name__}, not an FSDPModule")
    trace = UnshardTrace()
    undo: list[Callable[[], None]] = []
    try:
        for name, module in pairs:
            # prepend: our pre-hook runs before FSDP2's (which all-gathers); appended post-hook runs after FSDP2's.
            undo.append(
                module.register_forward_pre_hook(functools.partial(trace._forward_begin, name), prepend=True).remove
            )
            undo.append(module.register_forward_hook(functools.partial(trace._forward_end, name)).remove)
            groups = fsdp_param_groups(module)
            for i, group in enumerate(groups):
                undo.append(_patch(group, "unshard", _wrap_unshard(trace, name, i, group)))
                undo.append(_patch(group, "pre_backward", _wrap_pre_backward(trace, name, len(groups))))
                undo.append(_patch(group, "post_backward", _wrap_post_backward(trace, name)))
        yield trace
    finally:
        for fn in reversed(undo):
            fn()
