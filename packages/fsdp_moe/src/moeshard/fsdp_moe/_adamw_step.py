"""The one-pass AdamW update both of this package's AdamWs run (:class:`LocalExpertAdamW` over the
local experts' float32 masters, :class:`OnePassAdamW` over float32 parameters): the group options
it refuses, a group's hyper-parameters, and the step of one parameter, the triton pass on CUDA (``_triton``) or
torch's for-loop AdamW's tensor operations (``_single_tensor_adam``) elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from moeshard.fsdp_moe._local_experts import scaled

__all__ = [
    "UNSUPPORTED",
    "adamw_step",
    "adamw_step_split",
    "check_group",
    "hyper_parameters",
    "join_master_into",
    "joined_master",
    "local_tensor",
    "split_master",
    "triton_available",
]


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
    hyper = _step_hyper(lr, beta1, beta2, eps, weight_decay, step)
    contiguous = master.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()
    if master.is_cuda and contiguous and (out is None or out.is_contiguous()) and triton_available():
        from moeshard.fsdp_moe import _triton

        _triton.adamw_update(master, grad.contiguous(), exp_avg, exp_avg_sq, out, grad_factor, grad_mult, None, **hyper)
        return
    _adamw_ops(master, grad, exp_avg, exp_avg_sq, grad_factor, grad_mult, **hyper)
    if out is not None:
        out.copy_(master)


@torch.no_grad()
def adamw_step_split(
    hi: torch.Tensor,
    lo: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
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
    """:func:`adamw_step` of a float32 master held split (:func:`split_master`: ``hi`` the bf16 parameter, ``lo``
    the int16 low halves), both updated in place: the same float32 arithmetic, so the same master bit for bit; the
    parameter is the new master rounded to nearest with ties away from zero (round-to-even differs at ties)."""
    hyper = _step_hyper(lr, beta1, beta2, eps, weight_decay, step)
    contiguous = all(t.is_contiguous() for t in (hi, lo, exp_avg, exp_avg_sq))
    if hi.is_cuda and contiguous and triton_available():
        from moeshard.fsdp_moe import _triton

        _triton.adamw_update_split(hi, lo, grad.contiguous(), exp_avg, exp_avg_sq, grad_factor, grad_mult, **hyper)
        return
    master = joined_master(hi, lo)
    _adamw_ops(master, grad, exp_avg, exp_avg_sq, grad_factor, grad_mult, **hyper)
    new_hi, new_lo = split_master(master)
    hi.copy_(new_hi)
    lo.copy_(new_lo)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 tensor held as ``(hi, lo)``: ``hi`` bf16 (the value rounded to nearest, ties away from zero) and
    ``lo`` int16, with ``bits(master) == bits(hi) << 16 + lo`` exactly (int32 arithmetic); 4 bytes per element, as
    the float32 master alone, where the master and a bf16 copy of it take 6."""
    bits = master.view(torch.int32)
    low = bits & 0xFFFF  # the low 16 bits, 0..65535
    up = low >= 0x8000  # rounded up: the high half one more, the low half negative (no int32 overflow either way)
    hi = (bits >> 16) + up
    lo = low - up * 0x10000
    # (a NaN whose high half rounds past 0x7FFF wraps to another NaN's or -0's bits; every number stays exact)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def joined_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 tensor that :func:`split_master` split into ``hi`` and ``lo`` (a new tensor)."""
    bits = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)
    return bits.view(torch.float32)


def join_master_into(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`joined_master` written into ``out`` (float32, the halves' shape and device) in place, without
    temporaries: the same int32 arithmetic, so the same bits. Returns ``out``."""
    if out.dtype != torch.float32 or out.shape != hi.shape or out.device != hi.device:
        raise ValueError(
            f"join_master_into: out must be float32 of shape {tuple(hi.shape)} on {hi.device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    bits = out.view(torch.int32)
    bits.copy_(hi.view(torch.int16))  # sign-extended, as joined_master's .to(torch.int32)
    bits.bitwise_left_shift_(16)
    bits.add_(lo)
    return out


def _step_hyper(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> dict[str, float]:
    return {
        "decay": 1 - lr * weight_decay,
        "beta1": beta1,
        "beta2": beta2,
        "step_size": lr / (1 - beta1**step),
        "bias_correction2_sqrt": (1 - beta2**step) ** 0.5,
        "eps": eps,
    }


def _adamw_ops(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad_factor: float,
    grad_mult: torch.Tensor | None,
    *,
    decay: float,
    beta1: float,
    beta2: float,
    step_size: float,
    bias_correction2_sqrt: float,
    eps: float,
) -> None:
    # The float32 path's gradient (the master-mode backward's cast-and-scale, then the in-place clip), then
    # torch's _single_tensor_adam, operation for operation.
    g = scaled(grad, grad_factor, master.dtype)
    if grad_mult is not None:
        g.mul_(grad_mult.to(g.device))
    if decay != 1:
        master.mul_(decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)


@functools.cache
def triton_available() -> bool:
    try:
        from moeshard.fsdp_moe import _triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton here: the tensor operations
        return False
    return True
