"""Gradient-norm clipping over parameters that live on the two meshes (and plain replicated ones).

``get_total_norm`` / ``clip_grad_norm_`` take a sharded model, its parameters, or an
:class:`~moeshard.fsdp_moe.OptimizersContainer` (which then clips through its children, see ``_optim``). How the
pieces of the two meshes add up to one norm with one all-reduce: ``_norm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from moeshard.fsdp_moe._local_experts import local_experts_state
from moeshard.fsdp_moe._norm import check_norm_type, local_norms, multiply_grads_, reduce_norms, split_grads
from moeshard.fsdp_moe._optim import OptimizersContainer

__all__ = ["clip_grad_norm_", "get_total_norm"]

Parameters = nn.Module | Iterable[torch.Tensor] | torch.Tensor | OptimizersContainer


def _params(parameters: nn.Module | Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        for module in parameters.modules():
            st = local_experts_state(module)
            if st is not None and st.in_compute_dtype:
                raise ValueError(
                    "the model's local experts are updated by a LocalExpertAdamW: their param.grad is in the compute "
                    "dtype before the divide factor, which that optimizer applies; clip through the optimizer "
                    "container (container.clip_grad_norm_(max_norm) or clip_grad_norm_(container, max_norm))"
                )
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


@torch.no_grad()
def get_total_norm(
    parameters: Parameters,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The p-norm of all gradients as if the model lived in one process (every rank gets the same value).

    Args:
        parameters: a sharded model or its parameters (expert, non-expert and plain ones may be mixed), or an
            ``OptimizersContainer`` (its children's gradients; the model's local experts under a
            ``LocalExpertAdamW`` are counted only this way).
        norm_type: p of the p-norm, ``float("inf")`` for the max norm.
        group: the process group spanning the world; defaults to the default group.

    Returns:
        A float32 scalar tensor (on the GPU with NCCL, else on the CPU).
    """
    if isinstance(parameters, OptimizersContainer):
        return parameters.get_total_norm(norm_type, group=group)
    norm_type = check_norm_type(norm_type)
    sharded, replicated = split_grads([p.grad for p in _params(parameters) if p.grad is not None], group)
    return reduce_norms(local_norms(sharded, norm_type), local_norms(replicated, norm_type), norm_type, group=group)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Parameters,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip gradients in place by their global norm, as ``torch.nn.utils.clip_grad_norm_`` does in one process.

    The scale is ``min(1, max_norm / (total_norm + 1e-6))``, applied to every rank's local pieces; expert
    gradients (``Shard(1)`` on ep_fsdp) and non-expert ones (``Shard(0)`` on fsdp) are covered by one
    all-reduce of local sums (see ``_norm``). With an ``OptimizersContainer`` this is
    ``container.clip_grad_norm_(...)``: the coefficient may then be applied inside its next ``step()``.

    Args:
        parameters: a sharded model or its parameters, or an ``OptimizersContainer``.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise when the total norm is nan or inf.
        group: the process group spanning the world; defaults to the default group.

    Returns:
        The total norm before clipping (float32 scalar, equal on every rank).
    """
    if isinstance(parameters, OptimizersContainer):
        return parameters.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, group=group)
    params = _params(parameters)
    total = get_total_norm(params, norm_type, group=group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); pass "
            "error_if_nonfinite=False to clip anyway"
        )
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    multiply_grads_([p.grad for p in params if p.grad is not None], clip_coef)
    return total
