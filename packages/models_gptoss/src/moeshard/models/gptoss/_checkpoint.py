"""GPT-OSS's Hub tensors in our layout: the experts' interleaved gate/up rows reordered to gate rows first, the
transposed weights turned, and MXFP4 blocks dequantised exactly.

Hub layout (transformers ``GptOssExperts``): ``gate_up_proj [E, D, 2F]`` with gate and up interleaved along the last
dim (gate at even, up at odd columns), ``gate_up_proj_bias [E, 2F]`` likewise, ``down_proj [E, F, D]``,
``down_proj_bias [E, D]``. MXFP4 (``quantization_config.quant_method: mxfp4``): ``X_blocks`` uint8
``[E, out, in/32, 16]`` (two FP4 e2m1 values a byte, low nibble first) and ``X_scales`` uint8 ``[E, out, in/32]``
(a power of two ``2^(s - 127)`` per 32 values), i.e. ``[E, out, in]`` rows: ours, before the gate/up reordering.

:data:`HUB_LAYOUT` hands these conversions to ``moeshard.models.common``'s loader and writer (``HFFormat.stored``):
each rank reads and dequantises its own experts' rows, one tensor at a time; the writer writes the bf16 layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import torch

__all__ = ["FP4_VALUES", "HUB_LAYOUT", "GptOssHubLayout", "dequantize_mxfp4", "experts_from_hub", "experts_to_hub"]

_EXPERT_NAMES = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_MXFP4 = ("_blocks", "_scales")

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


def _expert_name(fqn: str) -> str | None:
    prefix, _, name = fqn.rpartition(".")
    return name if prefix.endswith(".mlp.experts") and name in _EXPERT_NAMES else None


class GptOssHubLayout:
    """GPT-OSS's expert tensors as the Hub stores them (a ``moeshard.models.common.StoredLayout``): bf16 in the Hub
    layout, or the weights as MXFP4 blocks and scales; every other tensor as it is."""

    def stored_keys(self, fqn: str, shape: tuple[int, ...], found: Set[str]) -> dict[str, tuple[int, ...]] | None:
        """The Hub keys and shapes of expert parameter ``fqn`` of our ``shape``: ``X_blocks``/``X_scales`` where
        the checkpoint holds either of them, else ``X`` (turned where ours is)."""
        name = _expert_name(fqn)
        if name is None:
            return None
        if name in ("gate_up_proj", "down_proj"):
            e, rows, cols = shape  # ours: [E, out, in]
            if any(fqn + suffix in found for suffix in _MXFP4):
                return {f"{fqn}_blocks": (e, rows, cols // 32, 16), f"{fqn}_scales": (e, rows, cols // 32)}
            return {fqn: (e, cols, rows)}
        return {fqn: tuple(shape)}

    def from_stored(self, fqn: str, stored: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Our layout (in ``dtype``) of the Hub tensors of ``fqn``; MXFP4 dequantised exactly in float32 first."""
        name = _expert_name(fqn)
        assert name is not None, fqn
        if f"{fqn}_blocks" in stored:
            rows = dequantize_mxfp4(stored[f"{fqn}_blocks"], stored[f"{fqn}_scales"])
            return (experts_from_hub("gate_up_proj_rows", rows) if name == "gate_up_proj" else rows).to(dtype)
        return experts_from_hub(name, stored[fqn]).to(dtype)

    def to_stored(self, fqn: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``{fqn: Hub layout}`` for an expert tensor (bf16 layout, unquantised), None for any other."""
        name = _expert_name(fqn)
        return None if name is None else {fqn: experts_to_hub(name, tensor)}


HUB_LAYOUT = GptOssHubLayout()
"""The layout GPT-OSS's ``HFFormat`` reads and writes (``GPT_OSS_FORMAT.stored``)."""
