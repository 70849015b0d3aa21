"""Every function of ``moeshard.train._torch_internals`` (the one place the app reads torch's private parts) against
the installed torch, in one process on the CPU. Where torch moved an internal, the function raises the line naming
torch's version and that internal, which is this test's failure message."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from moeshard.train import _torch_internals as ti

# The line every function raises where its internal is gone: torch's version, what moved, and who reads it.
_MOVED = r"^torch {v}: {what} \(used by moeshard\.train\._torch_internals\.{fn}\)$"


def _moved(what: str, fn: str) -> str:
    return _MOVED.format(v=re.escape(torch.__version__), what=re.escape(what), fn=fn)


def test_every_internal_is_where_it_is_read():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = ti.default_store()
        store.set("key", "value")
        assert store.get("key") == b"value"
        group = dist.new_group([0])
        assert ti.resolve_process_group(group.group_name) is group
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert ti.op_argument_names(torch.ops.c10d.allreduce_.default)[:2] == ["tensors", "process_group"]
    assert "group_name" in ti.op_argument_names(torch.ops._c10d_functional.all_reduce.default)

    seen = []

    class Names(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Names():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen
    if not torch.cuda.is_available():
        return
    ti.record_memory_history(max_entries=1000)
    torch.ones(8, device="cuda")
    ti.stop_memory_history()


def test_the_memory_history_functions_are_there(tmp_path, monkeypatch):
    # CPU: torch's functions exist (they need CUDA only when called); record what the app's functions pass them
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    ti.record_memory_history(max_entries=7)
    ti.dump_memory_snapshot(str(tmp_path / "m.pickle"))
    ti.stop_memory_history()
    assert calls == [
        ("record", {"max_entries": 7}),
        ("dump", str(tmp_path / "m.pickle")),
        ("record", {"enabled": None}),
    ]


def test_a_moved_internal_is_named_with_torchs_version(monkeypatch):
    class Stand:  # an operator of a torch that dropped its schema
        pass

    with pytest.raises(RuntimeError, match=_moved("Stand no longer has _schema", "op_argument_names")):
        ti.op_argument_names(Stand())
    c10d = "torch.distributed.distributed_c10d no longer has"
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(RuntimeError, match=_moved(f"{c10d} _get_default_store", "default_store")):
        ti.default_store()
    monkeypatch.delattr(dist.distributed_c10d, "_resolve_process_group")
    with pytest.raises(RuntimeError, match=_moved(f"{c10d} _resolve_process_group", "resolve_process_group")):
        ti.resolve_process_group("0")
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    monkeypatch.delattr(torch.cuda.memory, "_dump_snapshot")
    for fn, name in (
        (lambda: ti.record_memory_history(max_entries=1), "record_memory_history"),
        (ti.stop_memory_history, "stop_memory_history"),
    ):
        with pytest.raises(RuntimeError, match=_moved("torch.cuda.memory no longer has _record_memory_history", name)):
            fn()
    with pytest.raises(
        RuntimeError, match=_moved("torch.cuda.memory no longer has _dump_snapshot", "dump_memory_snapshot")
    ):
        ti.dump_memory_snapshot("unused.pickle")
