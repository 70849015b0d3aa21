"""Every private part of torch this package reads, in one place, each behind a small named function.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them). Nothing else in the package
touches a private name of torch.

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`sm_carveout` / :func:`set_sm_carveout`: ``torch._C._get_sm_carveout_experimental`` /
  ``_set_sm_carveout_experimental``, the number of SMs cuBLAS GEMMs leave free, so that an all-to-all in flight
  keeps SMs to run on.
- :func:`mark_rows_dynamic`: ``torch._dynamo.maybe_mark_dynamic``, compiling a kernel for any row count while
  keeping its widths static (``torch.compile(dynamic=True)`` makes every dim symbolic).
- :func:`foreach_norm`: ``torch._foreach_norm``, a tensor's norm in float32 read once, without a float32 copy of it.
- :data:`TorchDispatchMode`: the base class of a dispatch mode (``torch.utils._python_dispatch``), for the test
  helper that counts the operations a step runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TorchDispatchMode", "foreach_norm", "mark_rows_dynamic", "set_sm_carveout", "sm_carveout"]


def _moved(what: str, used_by: str) -> RuntimeError:
    """The one line raised when an internal this package reads is gone from the installed torch."""
    return RuntimeError(f"torch {torch.__version__}: {what} (used by {__name__}.{used_by})")


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # the package works without it; only a mode built on it says what moved

    class TorchDispatchMode:  # type: ignore[no-redef]
        """Stands for torch's dispatch mode base class where the installed torch moved it."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise _moved("torch.utils._python_dispatch no longer has TorchDispatchMode", "TorchDispatchMode")


def sm_carveout() -> int | None:
    """The SMs cuBLAS leaves free now (None: none set)."""
    fn = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if fn is None:
        raise _moved("torch._C no longer has _get_sm_carveout_experimental", "sm_carveout")
    return fn()


def set_sm_carveout(sms: int | None) -> None:
    """Make cuBLAS leave ``sms`` SMs free (None: back to none)."""
    fn = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if fn is None:
        raise _moved("torch._C no longer has _set_sm_carveout_experimental", "set_sm_carveout")
    fn(sms)


def mark_rows_dynamic(t: torch.Tensor) -> None:
    """Let ``torch.compile`` treat ``t``'s dim 0 as symbolic (where it can; a static size is kept otherwise)."""
    fn = getattr(getattr(torch, "_dynamo", None), "maybe_mark_dynamic", None)
    if fn is None:
        raise _moved("torch._dynamo no longer has maybe_mark_dynamic", "mark_rows_dynamic")
    fn(t, 0)


def foreach_norm(tensors: Sequence[torch.Tensor], norm_type: float, *, dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each tensor, in ``dtype``, in one vectorised kernel per device and dtype."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is None:
        raise _moved("torch no longer has _foreach_norm", "foreach_norm")
    return list(fn(list(tensors), norm_type, dtype=dtype))
