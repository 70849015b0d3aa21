"""Replays of a kernel library's entry point: its host code run once per signature instead of once per call.

An *entry point* here is a Python function that checks its arguments, chooses a configuration, allocates scratch
tensors and launches already-compiled kernels it finds in *kernel caches* (objects whose ``cache`` attribute is the
dict of compiled functions, as FlashAttention 4's ``compile_cache``). Its host work per call can exceed the
kernels' own launch cost many times over (``benchmarks/fa4_host.py``). :class:`Replays` records, for one call, what
the entry point did on the device, in order:

- the aten operations it ran (allocations included), found by a ``TorchDispatchMode``; view operations are not
  kept: a view is rebuilt where it is used, from the tensor it views;
- each compiled kernel it called, with its arguments (a kernel's own operations are not the entry point's).

A later call with the same signature (every named tensor's shape, strides, dtype, device and 16-byte alignment,
and the caller's other arguments) replays the record on its own tensors: the same operations and kernels with the
same arguments, the tensors they read mapped to the new call's (the named arguments, the record's own
allocations, or views of either), with none of the entry point's host code.

A record is taken only where it is complete and checked, else the signature keeps calling the entry point:

- on the signature's second call (its first may compile kernels), while no kernel cache gains an entry;
- no operation reads a value back to the host (``.item()``), and every kernel was found in a cache;
- the replay, run once at once into fresh outputs, gives what the entry point gave (relative difference at most
  1e-2 per output: a backward that sums with atomics is not bitwise reproducible).

A tensor the record uses that was neither a named argument, nor allocated during the call, nor a view of either
(a buffer the library keeps between calls) is held by the record and used as it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Replays"]

_ATTEMPTS = 3
"""Calls of one signature that may try to take a record (one that saw a kernel compiled is not kept)."""
_TOLERANCE = 1e-2
_MISSING = object()

# A reference to a tensor of a call: ("arg", name), ("new", index of the record's allocation), ("held", tensor),
# or ("view", base reference, shape, stride, storage offset from the base's).
Ref = tuple


def _signature(tensors: dict[str, torch.Tensor], extra: tuple) -> tuple:
    return (
        tuple(
            (name, tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for name, t in tensors.items()
        ),
        extra,
    )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` that a tensor's elements span."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if n > 0)
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size() if t.numel() else start


class _Recording(TorchDispatchMode):
    """The operations and kernel calls of one call of an entry point, as references to its tensors."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.known: list[tuple[Ref, torch.Tensor]] = [(("arg", n), t) for n, t in named.items()]
        self.steps: list[tuple] = []
        self.allocated = 0
        self.inside_kernel = False
        self.kernels = 0
        self.refusal: str | None = None

    # ---- references ------------------------------------------------------------------------------------------
    def ref(self, t: torch.Tensor) -> Ref:
        for r, k in self.known:
            if k is t:
                return r
        start, end = _extent(t)
        storage = t.untyped_storage().data_ptr()
        best = None
        for r, k in self.known:
            if k.dtype != t.dtype or k.device != t.device or k.untyped_storage().data_ptr() != storage:
                continue
            k_start, k_end = _extent(k)
            if not (k_start <= start and end <= k_end):
                continue
            if k_start == start and tuple(k.shape) == tuple(t.shape) and k.stride() == t.stride():
                return r
            if best is None or k_start > best[1]:  # the closest base that holds the view
                best = (r, k_start, k)
        if best is not None:
            r, _, k = best
            return ("view", r, tuple(t.shape), t.stride(), t.storage_offset() - k.storage_offset())
        return ("held", t)

    def template(self, args: Any) -> tuple[Any, list[tuple[tuple, Ref]]]:
        """``args`` with every tensor replaced by None (the record holds no tensor of the call), and each tensor's
        place (indices into tuples, lists and dicts) with its reference."""
        slots: list[tuple[tuple, Ref]] = []

        def walk(x, path):
            if isinstance(x, torch.Tensor):
                slots.append((path, self.ref(x)))
                return None
            if isinstance(x, dict):
                return {k: walk(v, (*path, k)) for k, v in x.items()}
            if isinstance(x, (tuple, list)):
                items = [walk(v, (*path, i)) for i, v in enumerate(x)]
                return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            return x

        return walk(args, ()), slots

    # ---- what the entry point does ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside_kernel:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:  # what follows may depend on the value
            self.refusal = "the entry point reads a tensor's value on the host"
        if func.is_view:
            return out
        template = self.template((args, kwargs))
        results = tree_flatten(out)[0]
        for t in results:  # in-place and out= operations return their argument, which is known already
            if isinstance(t, torch.Tensor) and all(k is not t for _, k in self.known):
                self.known.append((("new", self.allocated), t))
                self.allocated += 1
        self.steps.append(
            ("op", func, template, [self.ref(t) if isinstance(t, torch.Tensor) else None for t in results])
        )
        return out

    def kernel(self, fn: Callable, args: tuple) -> Any:
        self.steps.append(("kernel", fn, self.template(args)))
        self.kernels += 1
        self.inside_kernel = True
        try:
            return fn(*args)
        finally:
            self.inside_kernel = False


class _SpyCache(dict):
    """A kernel cache's dict during a recording: its kernels are handed out wrapped; an insertion is noted."""

    def __init__(self, original: dict, recording: _Recording) -> None:
        super().__init__(original)
        self.recording, self.inserted = recording, False

    def _spy(self, fn):
        return None if fn is None else (lambda *a: self.recording.kernel(fn, a))

    def __getitem__(self, key):
        return self._spy(super().__getitem__(key))

    def get(self, key, default=None):
        fn = super().get(key, _MISSING)
        return default if fn is _MISSING else self._spy(fn)

    def __setitem__(self, key, value) -> None:
        self.inserted = True
        super().__setitem__(key, value)


class _Plan:
    """A recorded call, replayed on another call's tensors."""

    def __init__(self, steps: list[tuple]) -> None:
        self.steps = steps

    def describe(self) -> list[str]:
        """One line per step: an operation or a kernel, and the tensors it is given."""
        lines = []
        for kind, fn, (_, slots), *_ in self.steps:
            name = str(fn) if kind == "op" else getattr(fn, "__name__", type(fn).__name__)
            lines.append(f"{kind} {name}({', '.join(_describe(r) for _, r in slots)})")
        return lines

    def run(self, named: dict[str, torch.Tensor]) -> None:
        new: list[torch.Tensor] = []  # the record's allocations, in order
        for step in self.steps:
            template, slots = step[2]
            args = _filled(template, [(p, _resolve(r, named, new)) for p, r in slots])
            if step[0] == "kernel":
                step[1](*args)
                continue
            out = step[1](*args[0], **args[1])
            for t, r in zip(tree_flatten(out)[0], step[3], strict=True):
                if r is not None and r[0] == "new" and r[1] == len(new):
                    new.append(t)


def _resolve(r: Ref, named: dict[str, torch.Tensor], new: list[torch.Tensor]) -> torch.Tensor:
    # A module function, not a closure over ``new``: a recursive closure is a reference cycle, which would keep the
    # call's scratch tensors alive until the garbage collector runs.
    kind = r[0]
    if kind == "arg":
        return named[r[1]]
    if kind == "new":
        return new[r[1]]
    if kind == "held":
        return r[1]
    base = _resolve(r[1], named, new)
    return base.as_strided(r[2], r[3], base.storage_offset() + r[4])


def _filled(template: Any, values: list[tuple[tuple, torch.Tensor]]) -> Any:
    """``template`` (tuples, lists and dicts) with each value put at its place; only the containers on a value's
    path are rebuilt."""
    if not values:
        return template
    if values[0][0] == ():
        return values[0][1]
    by_key: dict[Any, list[tuple[tuple, torch.Tensor]]] = {}
    for p, v in values:
        by_key.setdefault(p[0], []).append((p[1:], v))
    if isinstance(template, dict):
        return {k: _filled(x, by_key[k]) if k in by_key else x for k, x in template.items()}
    items = [_filled(x, by_key[i]) if i in by_key else x for i, x in enumerate(template)]
    if isinstance(template, list):
        return items
    return type(template)(*items) if hasattr(template, "_fields") else tuple(items)


def _describe(r: Ref) -> str:
    if r[0] == "arg":
        return r[1]
    if r[0] == "new":
        return f"new{r[1]}"
    if r[0] == "held":
        t = r[1]
        return f"held {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device.type}"
    return f"view of {_describe(r[1])} {r[2]}"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    if not torch.equal(a.isfinite(), b.isfinite()):
        return False
    a, b = a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)
    return bool((a - b).norm() <= _TOLERANCE * b.norm().clamp_min(1e-30))


class Replays:
    """Calls of one entry point, replayed per signature where a checked record of it exists (module docstring).

    Args:
        caches: returns the kernel caches the entry point takes its kernels from (objects with a ``cache`` dict).
    """

    def __init__(self, caches: Callable[[], Iterable[Any]]) -> None:
        self._caches = caches
        self._plans: dict[tuple, _Plan | int | str] = {}  # a plan, the calls seen so far, or why none is kept
        self._lock = threading.Lock()

    def refused(self) -> dict[tuple, str]:
        """The signatures that call the entry point every time, and why."""
        return {k: v for k, v in self._plans.items() if isinstance(v, str)}

    def plans(self) -> int:
        """How many signatures are replayed."""
        return sum(isinstance(v, _Plan) for v in self._plans.values())

    def describe(self) -> dict[tuple, list[str]]:
        """What each replayed signature runs, step by step (:meth:`_Plan.describe`)."""
        return {k: v.describe() for k, v in self._plans.items() if isinstance(v, _Plan)}

    def call(
        self,
        entry: Callable[[], Any],
        tensors: dict[str, torch.Tensor],
        outputs: tuple[str, ...],
        extra: tuple = (),
    ) -> None:
        """Run ``entry()`` (which reads and writes ``tensors``, writing the ``outputs`` among them) or its replay.

        ``extra``: every other argument the entry point is given (hashable); part of the signature."""
        key = _signature(tensors, extra)
        state = self._plans.get(key, 0)
        if isinstance(state, _Plan):
            state.run(tensors)
            return
        if isinstance(state, str) or state == 0 or torch.compiler.is_compiling():
            entry()
            if state == 0:
                self._plans[key] = 1
            return
        with self._lock:
            self._plans[key] = self._record(entry, tensors, outputs, attempt=state)

    def _record(self, entry, tensors, outputs, attempt: int) -> _Plan | int | str:
        recording = _Recording(tensors)
        caches = [c for c in self._caches() if isinstance(getattr(c, "cache", None), dict)]
        spies = [_SpyCache(c.cache, recording) for c in caches]
        originals = [c.cache for c in caches]
        try:
            for c, s in zip(caches, spies, strict=True):
                c.cache = s
            with recording:
                entry()
        finally:
            for c, o, s in zip(caches, originals, spies, strict=True):
                o.update({k: v for k, v in dict.items(s) if k not in o})
                c.cache = o
        if recording.refusal is not None:
            return recording.refusal
        if any(s.inserted for s in spies):
            return attempt + 1 if attempt < _ATTEMPTS else "a kernel was compiled during every recorded call"
        if recording.kernels == 0:
            return "no compiled kernel was called from a kernel cache"
        plan = _Plan(recording.steps)
        fresh = {
            n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if n in outputs else t
            for n, t in tensors.items()
        }
        try:
            plan.run(fresh)
        except Exception as e:  # a record that cannot run on other tensors is not kept
            return f"the replay failed: {type(e).__name__}: {e}"
        differ = [n for n in outputs if not _close(fresh[n], tensors[n])]
        if differ:
            return f"the replay's {', '.join(differ)} differ from the entry point's"
        return plan
