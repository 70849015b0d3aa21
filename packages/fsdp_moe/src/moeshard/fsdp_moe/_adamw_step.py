"""The one-pass AdamW update both of this package's AdamWs run (:class:`~moeshard.fsdp_moe.LocalExpertAdamW` over the
local experts' float32 masters, :class:`~moeshard.fsdp_moe.OnePassAdamW` over float32 parameters): the group options
it refuses, a group's hyper-parameters, and the step of one parameter, the triton pass on CUDA (``_triton``) or
torch's for-loop AdamW's tensor operations (``_single_tensor_adam``) elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from moeshard.fsdp_moe._local_experts import scaled

__all__ = ["UNSUPPORTED", "adamw_step", "check_group", "hyper_parameters", "local_tensor", "triton_available"]


# Group options of torch's AdamW the one-pass update does not implement (each must be falsy).
UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def check_group(group: dict[str, Any], where: str, owner: str = "LocalExpertAdamW") -> None:
    """Refuse what the one-pass update does not implement (``owner``: the optimizer's name, for the message)."""
    on = [k for k in UNSUPPORTED if group.get(k)]
    if on:
        raise ValueError(
            f"{owner}: {where} sets {', '.join(on)}, which its one-pass update does not implement; turn them off, "
            "or use torch's AdamW (build_optimizer: fuse_local_experts=False for the experts, fused=True or False "
            "for the rest)"
        )
    if not group.get("decoupled_weight_decay", True) and group.get("weight_decay"):
        raise ValueError(
            f"{owner}: {where} asks for L2 weight decay (decoupled_weight_decay=False); the one-pass update is "
            "AdamW's (decoupled weight decay)"
        )
    for key in ("lr", "betas", "eps", "weight_decay"):
        values = group[key] if key == "betas" else (group[key],)
        if any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"{owner}: {where} has a tensor {key}; give it as a float")
    beta1, beta2 = group["betas"]
    if not (
        group["lr"] >= 0 and group["eps"] >= 0 and group["weight_decay"] >= 0 and 0 <= beta1 < 1 and 0 <= beta2 < 1
    ):
        raise ValueError(
            f"{owner}: {where} has an invalid hyper-parameter (lr {group['lr']}, betas {group['betas']}, "
            f"eps {group['eps']}, weight_decay {group['weight_decay']}); lr, eps, weight_decay >= 0, betas in [0, 1)"
        )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece; any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def hyper_parameters(group: dict[str, Any]) -> dict[str, float]:
    """A parameter group's AdamW hyper-parameters as :func:`adamw_step` takes them (floats)."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "eps": float(group["eps"]),
        "weight_decay": float(group["weight_decay"]),
    }


@torch.no_grad()
def adamw_step(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    *,
    grad_factor: float,
    grad_mult: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW step of ``master`` (float32, in place) from ``grad * grad_factor * grad_mult``; ``out`` (the
    compute-dtype parameter, or None) receives the new master, cast. The triton pass on CUDA where the tensors are
    contiguous, torch's for-loop AdamW's tensor operations otherwise."""
    bias_correction1 = 1 - beta1**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    contiguous = master.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()
    if master.is_cuda and contiguous and (out is None or out.is_contiguous()) and triton_available():
        from moeshard.fsdp_moe import _triton

        _triton.adamw_update(
            master,
            grad.contiguous(),
            exp_avg,
            exp_avg_sq,
            out,
            grad_factor,
            grad_mult,
            None,
            decay=1 - lr * weight_decay,
            beta1=beta1,
            beta2=beta2,
            step_size=step_size,
            bias_correction2_sqrt=bias_correction2_sqrt,
            eps=eps,
        )
        return
    # The float32 path's gradient (the master-mode backward's cast-and-scale, then the in-place clip), then
    # torch's _single_tensor_adam, operation for operation.
    g = scaled(grad, grad_factor, master.dtype)
    if grad_mult is not None:
        g.mul_(grad_mult.to(g.device))
    if weight_decay != 0:
        master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.copy_(master)


@functools.cache
def triton_available() -> bool:
    try:
        from moeshard.fsdp_moe import _triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton here: the tensor operations
        return False
    return True
