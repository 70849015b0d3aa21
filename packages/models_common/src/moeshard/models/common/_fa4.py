"""FlashAttention 4's causal attention kernels (the ``flash-attn-4`` package, ``flash_attn.cute``) for the model's
plain causal rows: its Hopper path on compute capability 9.x, its Blackwell path on 10.x.

# B batch, S sequence, H query heads, G key/value heads, D head size

The kernels take ``[B, S, heads, D]`` tensors, the layout the attention projections write, and return the output in
that layout and the log-sum-exp ``[B, H, S]`` in float32, which is what the backward reads; the output and the
log-sum-exp are allocated here so that a fake (meta) call gives the same shapes and strides. At Qwen3-30B-A3B's
shape its kernels are faster than cuDNN's, which SDPA runs otherwise, and its host code slower, which gives back part
of that where the launch queue runs short (the figures: ``docs/performance.md``).

The package is optional (``pip install 'moeshard-models-common[fa4]'``); :func:`fa4_unavailable` says why it cannot
run on a device, and the model refuses ``AttentionOptions(kernel="fa4")`` with that reason before its first layer.
Its backward accumulates dq with atomics: like cuDNN's, it is not bitwise deterministic from run to run.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["fa4_applies", "fa4_backward", "fa4_forward", "fa4_unavailable"]

_INSTALL = "pip install 'moeshard-models-common[fa4]' (the flash-attn-4 package)"


@functools.cache
def _interface():
    """``flash_attn.cute.interface`` (its forward and backward entry points), or the import error as a string."""
    try:
        from flash_attn.cute import interface
    except Exception as e:  # absent, or present without its compiler (nvidia-cutlass-dsl)
        return f"flash_attn.cute does not import ({type(e).__name__}: {e}); {_INSTALL}"
    return interface


def fa4_unavailable(device: torch.device | str) -> str | None:
    """Why FlashAttention 4's kernels cannot run on ``device``, or None where they can: a CUDA device of compute
    capability 9.x or 10.x with ``flash_attn.cute`` importable."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashAttention 4 runs on CUDA devices only, not on {device.type}"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"FlashAttention 4's kernels are built for compute capability 9.x and 10.x, this GPU is {major}.x"
    found = _interface()
    return found if isinstance(found, str) else None


def fa4_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> bool:
    """Whether FlashAttention 4 computes this causal attention (``[B, H, S, D]`` as SDPA takes it): no dropout, CUDA,
    half precision, one head size for q, k and v, a multiple of 8 up to 256. Shapes and dtypes only, so a compiled
    caller traces it without a graph break."""
    d = q.shape[-1]
    return (
        dropout == 0
        and q.dim() == 4
        and q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16)
        and k.shape[-1] == d
        and v.shape[-1] == d
        and d % 8 == 0
        and d <= 256
    )


def _contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fa4_forward(
    q_BSHD: torch.Tensor, k_BSGD: torch.Tensor, v_BSGD: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention's output ``[B, S, H, D]`` (q's dtype) and log-sum-exp ``[B, H, S]`` (float32)."""
    b, s, h, _ = q_BSHD.shape
    out = torch.empty((b, s, h, v_BSGD.shape[-1]), dtype=q_BSHD.dtype, device=q_BSHD.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q_BSHD.device)
    interface = _interface()
    if isinstance(interface, str):
        raise RuntimeError(interface)
    q, k, v = (_contiguous_rows(t) for t in (q_BSHD, k_BSGD, v_BSGD))
    interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True, out=out, lse=lse)
    return out, lse


def fa4_backward(
    grad_out_BSHD: torch.Tensor,
    q_BSHD: torch.Tensor,
    k_BSGD: torch.Tensor,
    v_BSGD: torch.Tensor,
    out_BSHD: torch.Tensor,
    lse_BHS: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v (their shapes and strides, ``[B, S, heads, D]``) from the forward's output and
    log-sum-exp."""
    interface = _interface()
    if isinstance(interface, str):
        raise RuntimeError(interface)
    q, k, v, out, grad_out = (_contiguous_rows(t) for t in (q_BSHD, k_BSGD, v_BSGD, out_BSHD, grad_out_BSHD))
    dq, dk, dv = (torch.empty_like(t) for t in (q_BSHD, k_BSGD, v_BSGD))
    interface._flash_attn_bwd(q, k, v, out, grad_out, lse_BHS, softmax_scale=scale, causal=True, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv
