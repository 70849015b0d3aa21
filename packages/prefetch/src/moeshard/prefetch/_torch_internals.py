"""Every private part of torch this package reads, in one place, each behind a small named function.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them), instead of an
``AttributeError`` deep inside a recorded step. Nothing else in the package touches a private name of torch.

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`fsdp_param_groups`: FSDP2's parameter groups of a unit (``FSDPModule._get_fsdp_state()``, then
  ``_fsdp_param_groups``, or ``_fsdp_param_group`` before torch 2.13). Their ``unshard``, ``pre_backward`` and
  ``post_backward`` are where every all-gather and backward of a unit passes; ``FSDPModule`` exposes no hook there.
- :func:`all_gather_result`: ``FSDPParamGroup._all_gather_result``, the pending all-gather of a group, which tells
  an ``unshard`` call that issued an all-gather from one that found the unit gathered already.
- :func:`in_backward`: ``torch._C._current_graph_task_id``, the test FSDP2 itself uses to tell backward from
  forward (a graph task runs only inside autograd's engine).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["all_gather_result", "fsdp_param_groups", "in_backward"]


def _moved(what: str, used_by: str) -> RuntimeError:
    """The one line raised when an internal this package reads is gone from the installed torch."""
    return RuntimeError(f"torch {torch.__version__}: {what} (used by {__name__}.{used_by})")


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The FSDP2 parameter groups of the unit ``module`` (one per mesh of the unit; none for a unit without
    parameters)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        raise _moved("FSDPModule no longer has _get_fsdp_state", "fsdp_param_groups")
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.13: one group per mesh of the unit
    if groups is not None:
        return list(groups)
    if not hasattr(state, "_fsdp_param_group"):
        raise _moved("FSDPState has neither _fsdp_param_groups nor _fsdp_param_group", "fsdp_param_groups")
    group = state._fsdp_param_group
    return [] if group is None else [group]


def all_gather_result(group: Any) -> Any:
    """The pending all-gather of the FSDP2 parameter group ``group``: None when none is in flight."""
    if not hasattr(group, "_all_gather_result"):
        raise _moved(f"{type(group).__name__} no longer has _all_gather_result", "all_gather_result")
    return group._all_gather_result


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a backward hook, or a recomputation of
    activation checkpointing)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    if current is None:
        raise _moved("torch._C no longer has _current_graph_task_id", "in_backward")
    return current() != -1
