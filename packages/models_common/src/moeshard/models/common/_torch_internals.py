"""Every private part of torch this package reads, in one place, each behind a small named function; and the one
deprecated torch function it used, rebuilt here from public parts.

A torch release may rename or drop any of these without notice. Each function here checks that what it reads is
still there and otherwise raises one ``RuntimeError`` naming the installed torch, the internal that moved and the
function that reads it (``tests/test_torch_internals.py`` calls every one of them).

Why each private access remains (torch 2.11-2.15 offer no public way to do the same):

- :func:`shard_offset`: ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, where this
  rank's piece of a DTensor starts in the global tensor (the same function DCP uses to place shards); reading a
  checkpoint reads exactly that box.
- :func:`foreach_mul`: ``torch._foreach_mul``, products of a list of tensors by one factor in one vectorised kernel
  per dtype (what ``torch.nn.utils.clip_grad_norm_`` calls).
- :func:`causal_attention_cpu` / :func:`causal_attention_cpu_backward` and :func:`causal_attention_cudnn` /
  :func:`causal_attention_cudnn_backward`: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and
  ``_scaled_dot_product_cudnn_attention`` with their backward ops, the kernels behind
  ``F.scaled_dot_product_attention``. The public function returns the output only; the kept attention needs the
  log-sum-exp (and cuDNN's random state) to run the backward from a kept output without computing it again.

- :func:`has_call_hooks`: ``nn.Module``'s hook dictionaries (``_forward_hooks`` and the like, and the global ones in
  ``torch.nn.modules.module``): whether calling a module runs more than its ``forward``. The kept output projection
  computes a linear module's output without calling it, which is right only for a module without hooks (a LoRA
  adapter on ``o_proj`` is a forward hook).

What torch deprecates and this package keeps as its own:

- :func:`all_reduce_sum`: ``torch.distributed.nn.functional.all_reduce`` (a ``FutureWarning`` on torch 2.13, which
  points to the private ``torch.distributed._functional_collectives``), a SUM all-reduce whose backward is the SUM
  all-reduce of the gradient. This is the deprecated function's autograd Function (same copy, same collectives) on
  the public ``dist.all_reduce``, so nothing private is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "all_reduce_sum",
    "causal_attention_cpu",
    "causal_attention_cpu_backward",
    "causal_attention_cudnn",
    "causal_attention_cudnn_backward",
    "foreach_mul",
    "has_call_hooks",
    "shard_offset",
]

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


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


def has_call_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs anything besides its ``forward``: hooks of its own (forward, pre-forward,
    backward) or the global module hooks. Code that would compute a module's output without calling it must call it
    where this is True."""
    from torch.nn.modules import module as module_py

    for holder, names in ((module, _HOOKS), (module_py, _GLOBAL_HOOKS)):
        for name in names:
            hooks = getattr(holder, name, None)
            if not isinstance(hooks, dict):
                where = "torch.nn.Module" if holder is module else "torch.nn.modules.module"
                raise _moved(f"{where} no longer keeps {name}", "has_call_hooks")
            if hooks:
                return True
    return False


def _aten(name: str, used_by: str):
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        raise _moved(f"torch.ops.aten no longer has {name}", used_by)
    return op


def causal_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp)`` of causal attention over ``[B, H, S, D]`` tensors by the CPU flash kernel, no dropout."""
    op = _aten("_scaled_dot_product_flash_attention_for_cpu", "causal_attention_cpu")
    out, lse = op(q, k, v, 0.0, True, scale=scale)
    return out, lse


def causal_attention_cpu_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`causal_attention_cpu` from its outputs and the output's gradient."""
    op = _aten("_scaled_dot_product_flash_attention_for_cpu_backward", "causal_attention_cpu_backward")
    dq, dk, dv = op(grad_out, q, k, v, out, lse, 0.0, True, scale=scale)
    return dq, dk, dv


def causal_attention_cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, logsumexp, philox seed, philox offset)`` of causal attention over ``[B, H, S, D]`` CUDA tensors by
    cuDNN's kernel, no dropout."""
    op = _aten("_scaled_dot_product_cudnn_attention", "causal_attention_cudnn")
    out, lse, _, _, _, _, seed, offset, _ = op(q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, lse, seed, offset


def causal_attention_cudnn_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`causal_attention_cudnn` from its outputs and the output's gradient."""
    op = _aten("_scaled_dot_product_cudnn_attention_backward", "causal_attention_cudnn_backward")
    s_q, s_k = q.shape[-2], k.shape[-2]
    dq, dk, dv = op(grad_out, q, k, v, out, lse, seed, offset, None, None, None, s_q, s_k, 0.0, True, scale=scale)
    return dq, dk, dv


class _AllReduceSum(torch.autograd.Function):
    """``torch.distributed.nn.functional._AllReduce`` with ``op=SUM``: a sum over the group of a contiguous copy
    (the input is left as it is), and the same of the gradient, through this Function so it stays differentiable."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllReduceSum.apply(ctx.group, grad)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` summed over ``group`` (default: the world) as a new tensor, differentiable: the backward sums the
    group's gradients, as ``torch.distributed.nn.functional.all_reduce`` did (every rank must call it alike)."""
    return _AllReduceSum.apply(group, tensor)
