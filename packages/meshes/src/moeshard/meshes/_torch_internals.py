"""Every private part of torch this package reads, in one place, each behind a small named function.

A torch release may rename or drop it without notice; the function checks that it is still there and otherwise
raises one ``RuntimeError`` naming the installed torch, the internal that moved and the function that reads it
(``tests/test_torch_internals.py`` calls it). Nothing else in the package touches a private name of torch.

Why the private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`fake_store`: the ``fake`` process-group backend and its store live in
  ``torch.testing._internal.distributed.fake_pg`` (importing it registers the backend); it is how torch's own tests
  plan world sizes no machine has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["fake_store"]


def fake_store() -> dist.Store:
    """A store for ``init_process_group("fake", ...)``, the ``fake`` backend registered."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise RuntimeError(
            f"torch {torch.__version__}: torch.testing._internal.distributed.fake_pg no longer has FakeStore "
            f"(used by {__name__}.fake_store)"
        ) from e
    return FakeStore()
