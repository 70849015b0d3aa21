"""Every private part of torch the app reads, in one place, each behind a small named function.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them), instead of an
``AttributeError`` in the middle of a run. Nothing else in the app touches a private name of torch.

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`default_store`: ``torch.distributed.distributed_c10d._get_default_store``, the c10d store of the default
  process group, which the hang watchdog and the fault records share across ranks.
- :data:`TorchDispatchMode`: the base class of a dispatch mode (``torch.utils._python_dispatch``), which the
  communication accounting uses to see every collective a step issues.
- :func:`resolve_process_group`: ``torch.distributed.distributed_c10d._resolve_process_group``, the group behind a
  functional collective's ``group_name`` argument.
- :func:`op_argument_names`: ``OpOverload._schema``, the argument names of an operator, to read a collective's
  arguments by name.
- :func:`record_memory_history` / :func:`stop_memory_history` / :func:`dump_memory_snapshot`:
  ``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot``, the allocator's history that
  https://pytorch.org/memory_viz draws (what ``logging.profile.memory`` writes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TorchDispatchMode",
    "default_store",
    "dump_memory_snapshot",
    "op_argument_names",
    "record_memory_history",
    "resolve_process_group",
    "stop_memory_history",
]


def _moved(what: str, used_by: str) -> RuntimeError:
    """The one line raised when an internal the app reads is gone from the installed torch."""
    return RuntimeError(f"torch {torch.__version__}: {what} (used by {__name__}.{used_by})")


def _c10d(name: str, used_by: str) -> Any:
    fn = getattr(dist.distributed_c10d, name, None)
    if fn is None:
        raise _moved(f"torch.distributed.distributed_c10d no longer has {name}", used_by)
    return fn


def _cuda_memory(name: str, used_by: str) -> Any:
    fn = getattr(torch.cuda.memory, name, None)
    if fn is None:
        raise _moved(f"torch.cuda.memory no longer has {name}", used_by)
    return fn


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # the app runs without it; only the communication accounting says what moved

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands for torch's dispatch mode base class where the installed torch moved it."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise _moved("torch.utils._python_dispatch no longer has TorchDispatchMode", "TorchDispatchMode")


def default_store() -> dist.Store:
    """The c10d store of the default process group (initialised)."""
    return _c10d("_get_default_store", "default_store")()


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by ``group_name``."""
    return _c10d("_resolve_process_group", "resolve_process_group")(group_name)


def op_argument_names(op: Any) -> list[str]:
    """The names of ``op``'s arguments (an ``OpOverload``), in order."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise _moved(f"{type(op).__name__} no longer has _schema", "op_argument_names")
    return [a.name for a in schema.arguments]


def record_memory_history(max_entries: int) -> None:
    """Start recording the CUDA allocator's history (its last ``max_entries`` events)."""
    _cuda_memory("_record_memory_history", "record_memory_history")(max_entries=max_entries)


def stop_memory_history() -> None:
    """Stop recording the CUDA allocator's history."""
    _cuda_memory("_record_memory_history", "stop_memory_history")(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history to ``path`` (a pickle https://pytorch.org/memory_viz reads)."""
    _cuda_memory("_dump_snapshot", "dump_memory_snapshot")(path)
