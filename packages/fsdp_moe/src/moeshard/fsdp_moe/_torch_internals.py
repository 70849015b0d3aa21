"""Every private part of torch this package reads, in one place, each behind a small named function.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them), instead of an
``AttributeError`` deep inside a training step. Nothing else in the package touches a private name of torch; where
a public API does the same job (a DTensor's local piece: ``DTensor.to_local``) it is used instead.

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`fsdp_param_groups`: FSDP2's parameter groups of a unit (``FSDPModule._get_fsdp_state()``, then
  ``_fsdp_param_groups``, or ``_fsdp_param_group`` before torch 2.13). Reading a unit's mesh, its unsharded
  parameters and its post-backward needs them; ``FSDPModule`` exposes none of these.
- :func:`unsharded_param`: ``FSDPParam._unsharded_param``, the tensor a unit's forward receives as its weight,
  matched to tell which parameter a module is computing with.
- :func:`keeps_held_grad`, :func:`held_grad`, :func:`set_held_grad`: ``FSDPParam.unsharded_accumulated_grad``, the
  reduce-dtype gradient FSDP2 holds between micro-batches (torch 2.11-2.14). torch 2.15 has none (autograd
  accumulates in the reduce dtype itself); :func:`keeps_held_grad` says so, and the two others raise there.
- :func:`reduce_scatter_comm`: ``FSDPParamGroup._reduce_scatter_comm``, to see whether a unit still has FSDP2's
  default comm before giving it ours (``FSDPModule.set_custom_reduce_scatter`` sets one, nothing reads it).
- :data:`ReduceScatterBase`: the comm interface ``set_custom_reduce_scatter`` takes, defined in a private module
  (``torch.distributed.fsdp._fully_shard._fsdp_api``) and not exported.
- :func:`foreach_reduce_source`: the source of FSDP2's ``foreach_reduce``, read to check the order of buffer
  requests that ``OneRankReduceScatter`` relies on.
- :func:`foreach_norm` and :func:`foreach_mul_`: ``torch._foreach_norm`` / ``torch._foreach_mul_``, one kernel over a
  list of tensors (what ``torch.nn.utils.clip_grad_norm_`` itself calls); the public utilities only return a
  total norm.
- :func:`tree_map_only`: ``torch.utils._pytree.tree_map_only``, mapping the tensors of nested arguments and
  outputs as FSDP2's own casts do; torch has no public pytree module.
- :func:`tensor_version`: ``Tensor._version``, the in-place counter that tells whether a gradient changed since a
  value derived from it was recorded.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = [
    "ReduceScatterBase",
    "reduce_scatter_base",
    "foreach_mul_",
    "held_grad",
    "keeps_held_grad",
    "set_held_grad",
    "foreach_norm",
    "foreach_reduce_source",
    "fsdp_param_groups",
    "local_tensor",
    "reduce_scatter_comm",
    "tensor_version",
    "tree_map_only",
    "unsharded_param",
]

_HERE = __name__


def _moved(what: str, used_by: str) -> RuntimeError:
    """The one line raised when an internal this package reads is gone from the installed torch."""
    return RuntimeError(f"torch {torch.__version__}: {what} (used by {_HERE}.{used_by})")


def _declared(obj: Any, attr: str) -> bool:
    """Whether ``obj``'s class declares ``attr`` (an annotation on it or a base): FSDP2 annotates attributes that
    it sets only later (``_unsharded_param`` after the first all-gather)."""
    return any(attr in vars(cls).get("__annotations__", {}) for cls in type(obj).__mro__)


try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatterBase
except ImportError:  # a torch without custom comms: OneRankReduceScatter is then never installed
    ReduceScatterBase = object  # type: ignore[assignment,misc]


def reduce_scatter_base() -> type:
    """FSDP2's reduce-scatter comm interface (:data:`ReduceScatterBase`), or a RuntimeError where torch moved it."""
    if ReduceScatterBase is object:
        raise _moved("torch.distributed.fsdp._fully_shard._fsdp_api no longer has ReduceScatter", "reduce_scatter_base")
    return ReduceScatterBase


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


def unsharded_param(fsdp_param: Any) -> torch.Tensor | None:
    """``fsdp_param``'s unsharded parameter (what the unit's forward computes with), or None before the unit's
    first all-gather made it."""
    if hasattr(fsdp_param, "_unsharded_param"):
        return fsdp_param._unsharded_param
    if not _declared(fsdp_param, "_unsharded_param"):
        raise _moved(f"{type(fsdp_param).__name__} no longer has _unsharded_param", "unsharded_param")
    return None


def keeps_held_grad(fsdp_param: Any) -> bool:
    """Whether the installed torch's FSDP2 holds a reduce-dtype gradient for ``fsdp_param`` between backwards that
    do not reduce (``FSDPParam.unsharded_accumulated_grad``: torch 2.11 and 2.13; not torch 2.15)."""
    if isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property):
        return False  # torch 2.15: a read-only view of the parameter's .grad, "unused within FSDP"
    return hasattr(fsdp_param, "unsharded_accumulated_grad") or _declared(fsdp_param, "unsharded_accumulated_grad")


def held_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The reduce-dtype gradient FSDP2 holds for ``fsdp_param`` until its next reduce, or None."""
    if not keeps_held_grad(fsdp_param):
        raise _moved(f"{type(fsdp_param).__name__} no longer has unsharded_accumulated_grad", "held_grad")
    return getattr(fsdp_param, "unsharded_accumulated_grad", None)


def set_held_grad(fsdp_param: Any, grad: torch.Tensor) -> None:
    """Make ``grad`` the reduce-dtype gradient FSDP2 holds for ``fsdp_param`` (and reduces at its next reduce)."""
    if not keeps_held_grad(fsdp_param):
        raise _moved(f"{type(fsdp_param).__name__} no longer has unsharded_accumulated_grad", "set_held_grad")
    fsdp_param.unsharded_accumulated_grad = grad


def reduce_scatter_comm(group: Any) -> Any:
    """The reduce-scatter comm of the FSDP2 parameter group ``group`` (FSDP2's default, or one set by
    ``FSDPModule.set_custom_reduce_scatter``)."""
    if not hasattr(group, "_reduce_scatter_comm"):
        raise _moved(f"{type(group).__name__} no longer has _reduce_scatter_comm", "reduce_scatter_comm")
    return group._reduce_scatter_comm


def foreach_reduce_source() -> str:
    """The source text of FSDP2's ``foreach_reduce`` (the function that reduce-scatters a unit's gradients)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        return inspect.getsource(_fsdp_collectives.foreach_reduce)
    except (ImportError, AttributeError) as e:
        raise _moved(
            "torch.distributed.fsdp._fully_shard._fsdp_collectives.foreach_reduce is gone", "foreach_reduce_source"
        ) from e


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (``DTensor.to_local`` outside autograd); any other tensor as it is.

    For a DTensor that is not a parameter (a gradient) this is the DTensor's own local tensor, the same object
    every call, which ``_grad_records`` relies on to recognise a gradient; for a parameter torch >= 2.13 returns a
    new view of it each call (same storage, shape and device)."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: it moves with every in-place operation on ``t`` (or a view of it)."""
    try:
        return t._version
    except AttributeError as e:
        raise _moved("Tensor no longer has _version", "tensor_version") from e


def tree_map_only(cls: type, fn: Any, tree: Any) -> Any:
    """``tree`` (nested tuples, lists, dicts) with every leaf of type ``cls`` replaced by ``fn(leaf)``."""
    try:
        from torch.utils._pytree import tree_map_only as impl
    except ImportError as e:
        raise _moved("torch.utils._pytree no longer has tree_map_only", "tree_map_only") from e
    return impl(cls, fn, tree)


def foreach_norm(tensors: Sequence[torch.Tensor], norm_type: float, *, dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``norm_type`` norm of each tensor, in ``dtype``, in one vectorised kernel per device and dtype."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is None:
        raise _moved("torch no longer has _foreach_norm", "foreach_norm")
    return list(fn(list(tensors), norm_type, dtype=dtype))


def foreach_mul_(tensors: Sequence[torch.Tensor], scale: torch.Tensor | float) -> None:
    """Multiply each tensor in place by ``scale`` (a number or a one-element tensor), vectorised."""
    fn = getattr(torch, "_foreach_mul_", None)
    if fn is None:
        raise _moved("torch no longer has _foreach_mul_", "foreach_mul_")
    fn(list(tensors), scale)
