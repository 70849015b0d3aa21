"""Replays of a kernel library's entry point (``_replay``), on a toy library: an entry point that allocates scratch,
reads views of it and of its arguments, and launches kernels from a cache. What is replayed gives the entry
point's results; what cannot be recorded or checked keeps calling the entry point."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from moeshard.models.common._replay import Replays
from moeshard.models.common.testing import KernelCache


class _Library:
    """``out = 2 x + y`` through a zeroed scratch tensor and two cached kernels (``out`` written through views)."""

    def __init__(self, *, read_host=False, hidden_kernel=False, compile_every_call=False) -> None:
        self.read_host, self.hidden_kernel, self.compile_every_call = read_host, hidden_kernel, compile_every_call
        self.compile_cache = KernelCache()
        self.entries = self.launches = 0

    def _scale(self, x, scratch):
        scratch.add_(x, alpha=2.0)
        self.launches += 1

    def _add(self, scratch_t, y_t, out_t):
        out_t.copy_(scratch_t + y_t)
        self.launches += 1

    def entry(self, x, y, out):
        self.entries += 1
        if self.read_host and float(x.abs().sum()) < 0:
            raise AssertionError
        scratch = torch.zeros_like(x)
        key = ("scale", self.entries) if self.compile_every_call else "scale"
        if key not in self.compile_cache:
            self.compile_cache[key] = self._scale
        if "add" not in self.compile_cache:
            self.compile_cache["add"] = self._add
        self.compile_cache[key](x.detach(), scratch)
        if self.hidden_kernel:  # a launch the record does not see: not from a cache, no aten operation seen
            with _disable_current_modes():
                out.copy_(scratch + y)
            return
        self.compile_cache.get("add")(scratch.t(), y.t(), out.t())


def _calls(lib: _Library, replays: Replays, n: int, shape=(6, 4)) -> None:
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        out = torch.full(shape, float("nan"))
        named = {"x": x, "y": y, "out": out}
        replays.call(lambda named=named: lib.entry(**named), named, outputs=("out",), extra=(1.0,))
        torch.testing.assert_close(out, 2 * x + y)


def test_a_shape_replays_from_its_third_call():
    lib = _Library()
    replays = Replays(lambda: [lib.compile_cache])
    _calls(lib, replays, 5)
    assert lib.entries == 2 and replays.plans() == 1 and not replays.refused()
    assert lib.launches == 2 * 5 + 2  # the record's check runs both kernels once more
    _calls(lib, replays, 1, shape=(3, 4))  # another signature: the entry point again
    assert lib.entries == 3


@pytest.mark.parametrize(
    "what, reason",
    [
        ("read_host", "reads a tensor's value on the host"),
        ("hidden_kernel", "replay's out differ"),
        ("compile_every_call", "compiled during every recorded call"),
        ("no_cache", "no compiled kernel was called"),
    ],
)
def test_what_cannot_be_recorded_or_checked_calls_the_entry_point(what, reason):
    lib = _Library(**({what: True} if what != "no_cache" else {}))
    replays = Replays(lambda: [] if what == "no_cache" else [lib.compile_cache])
    _calls(lib, replays, 6)
    assert lib.entries == 6 and replays.plans() == 0
    assert [reason in why for why in replays.refused().values()] == [True]


def test_a_replay_frees_its_scratch_when_it_returns():
    """The scratch tensors a replay allocates are freed on return, not left to the garbage collector."""
    import gc
    import weakref

    lib = _Library()
    seen = []
    lib.compile_cache["scale"] = lambda x, scratch: (seen.append(weakref.ref(scratch)), lib._scale(x, scratch))
    replays = Replays(lambda: [lib.compile_cache])
    gc.disable()
    try:
        _calls(lib, replays, 4)
        assert lib.entries == 2 and replays.plans() == 1 and len(seen) == 5
        assert all(ref() is None for ref in seen)
    finally:
        gc.enable()
