"""Every function of ``moeshard.ep._torch_internals`` (the one place this package reads torch's private parts)
against the installed torch, on the CPU. Where torch moved an internal, the function raises the line naming
torch's version and that internal, which is this test's failure message."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from moeshard.ep import _torch_internals as ti


def test_every_internal_is_where_it_is_read():
    before = ti.sm_carveout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the carveout is experimental
        ti.set_sm_carveout(4)
        assert ti.sm_carveout() == 4
        ti.set_sm_carveout(before)
    assert ti.sm_carveout() == before
    t = torch.arange(12.0).reshape(4, 3)
    ti.mark_rows_dynamic(t)
    (norm,) = ti.foreach_norm([t], 2.0, dtype=torch.float32)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(t))

    class Count(ti.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count() as mode:
        t + 1
    assert mode.ops == ["aten.add.Tensor"]


def test_a_moved_internal_is_named_with_torchs_version(monkeypatch):
    monkeypatch.delattr(torch._C, "_get_sm_carveout_experimental")
    line = (
        rf"^torch {re.escape(torch.__version__)}: torch\._C no longer has _get_sm_carveout_experimental "
        r"\(used by moeshard\.ep\._torch_internals\.sm_carveout\)$"
    )
    with pytest.raises(RuntimeError, match=line):
        ti.sm_carveout()
