"""GPT-OSS's Hub tensors in our layout: the experts' interleaved gate/up rows reordered to gate rows first, the
transposed weights turned, and MXFP4 blocks dequantised exactly.

Hub layout (transformers ``GptOssExperts``): ``gate_up_proj [E, D, 2F]`` with gate and up interleaved along the last
dim (gate at even, up at odd columns), ``gate_up_proj_bias [E, 2F]`` likewise, ``down_proj [E, F, D]``,
``down_proj_bias [E, D]``. MXFP4 (``quantization_config.quant_method: mxfp4``): ``X_blocks`` uint8
``[E, out, in/32, 16]`` (two FP4 e2m1 values a byte, low nibble first) and ``X_scales`` uint8 ``[E, out, in/32]``
(a power of two ``2^(s - 127)`` per 32 values), i.e. ``[E, out, in]`` rows: ours, before the gate/up reordering.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "experts_from_hub", "experts_to_hub"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., out, in]`` from ``blocks [..., out, in/32, 16]`` and ``scales [..., out, in/32]``: every value is an
    FP4 code times its block's power of two, exact in any float dtype with the exponent range (float32, bfloat16).

    Raises:
        ValueError: shapes that are not MXFP4's.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 needs uint8 blocks [..., out, in/32, 16] and uint8 scales [..., out, in/32], got "
            f"{blocks.dtype} {list(blocks.shape)} and {scales.dtype} {list(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], -1)  # low nibble first
    values = lut[codes.long()] * torch.exp2(scales.to(torch.float32) - 127).unsqueeze(-1)
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


def _gate_first(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (gate at even indices of ``dim``) to gate rows first, then up rows."""
    idx = torch.arange(x.shape[dim], device=x.device)
    return torch.cat([x.index_select(dim, idx[0::2]), x.index_select(dim, idx[1::2])], dim=dim)


def _interleaved(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`_gate_first`."""
    gate, up = x.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def experts_from_hub(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One expert tensor of a Hub checkpoint (``gate_up_proj``, ``gate_up_proj_bias``, ``down_proj``,
    ``down_proj_bias``, bf16 layout) in our layout; ``gate_up_proj`` given as dequantised MXFP4 rows
    ``[E, 2F, D]`` (``name="gate_up_proj_rows"``) is reordered only."""
    if name == "gate_up_proj":
        return _gate_first(tensor.transpose(1, 2), 1).contiguous()
    if name == "gate_up_proj_rows":
        return _gate_first(tensor, 1).contiguous()
    if name == "gate_up_proj_bias":
        return _gate_first(tensor, 1).contiguous()
    if name == "down_proj":
        return tensor.transpose(1, 2).contiguous()
    if name == "down_proj_bias":
        return tensor
    raise ValueError(f"{name!r} is not a GPT-OSS expert tensor (gate_up_proj[_bias], down_proj[_bias])")


def experts_to_hub(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`experts_from_hub` (bf16 layout), what transformers loads."""
    if name == "gate_up_proj":
        return _interleaved(tensor, 1).transpose(1, 2).contiguous()
    if name == "gate_up_proj_bias":
        return _interleaved(tensor, 1).contiguous()
    if name == "down_proj":
        return tensor.transpose(1, 2).contiguous()
    if name == "down_proj_bias":
        return tensor
    raise ValueError(f"{name!r} is not a GPT-OSS expert tensor (gate_up_proj[_bias], down_proj[_bias])")
