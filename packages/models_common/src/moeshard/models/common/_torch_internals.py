"""Every private part of torch this package reads outside attention kernels, in one place, each behind a small
named function.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them).

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`shard_offset`: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, where this
  rank's piece of a DTensor starts in the global tensor (the same function DCP uses to place shards); reading a
  checkpoint reads exactly that box.
- :func:`foreach_mul`: ``torch._foreach_mul``, products of a list of tensors by one factor in one vectorised kernel
  per dtype (what ``torch.nn.utils.clip_grad_norm_`` calls).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

__all__ = ["foreach_mul", "shard_offset"]


def _moved(what: str, used_by: str) -> RuntimeError:
    """The one line raised when an internal this package reads is gone from the installed torch."""
    return RuntimeError(f"torch {torch.__version__}: {what} (used by {__name__}.{used_by})")


def shard_offset(param: DTensor) -> tuple[int, ...]:
    """The global index of the first element of this rank's piece of ``param``, per dim."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:
        raise _moved(
            "torch.distributed.tensor._utils no longer has compute_local_shape_and_global_offset", "shard_offset"
        ) from e
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(offset)


def foreach_mul(tensors: Sequence[torch.Tensor], factor: torch.Tensor | float) -> list[torch.Tensor]:
    """Each tensor times ``factor`` (a number or a one-element tensor), as new tensors."""
    fn = getattr(torch, "_foreach_mul", None)
    if fn is None:
        raise _moved("torch no longer has _foreach_mul", "foreach_mul")
    return list(fn(list(tensors), factor))
