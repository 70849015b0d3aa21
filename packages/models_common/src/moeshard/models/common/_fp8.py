"""FP8 Hub weights (DeepSeek-V3's format): ``X.weight`` in float8 with ``X.weight_scale_inv`` float32 per block of
``quantization_config.weight_block_size`` (128 x 128 by default); a weight is ``fp8 * scale`` of its block.
Dequantised to the parameter's dtype on load, a slice at a time (the scales are ~1/16384 of the elements)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from moeshard.models.common._safetensors import CheckpointError, SafetensorsDir

SCALE_SUFFIX = "_scale_inv"
"""The key of a weight's block scales: the weight's key plus this."""

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The float8 dtypes a Hub checkpoint stores block-scaled weights in."""


def fp8_block(config: PretrainedConfig | None) -> tuple[int, int]:
    """The ``[rows, cols]`` of one scale block (``quantization_config.weight_block_size``, default 128 x 128)."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    rows, cols = quant.get("weight_block_size", (128, 128))
    return int(rows), int(cols)


def _check_scale_shape(ckpt: SafetensorsDir, key: str, block: tuple[int, int]) -> None:
    shape = ckpt.info(key).shape
    want = tuple(-(-n // b) for n, b in zip(shape, block))
    got = ckpt.info(key + SCALE_SUFFIX).shape
    if len(shape) != 2 or got != want:
        raise CheckpointError(
            f"{key + SCALE_SUFFIX} has shape {list(got)}, a {list(shape)} weight in {block[0]}x{block[1]} blocks "
            f"needs {list(want)}: the config's quantization_config.weight_block_size and the checkpoint disagree"
        )


def read_scales(ckpt: SafetensorsDir, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole scale tensors of ``keys``' FP8 weights (a weight's scales are ~1/16384 of its elements)."""
    reqs = [(k + SCALE_SUFFIX, tuple(slice(None) for _ in ckpt.info(k + SCALE_SUFFIX).shape)) for k in keys]
    return {keys[i]: t.float() for i, _, t in ckpt.read(reqs)}


def dequantize(
    tensor: torch.Tensor,
    scale: torch.Tensor,
    slices: tuple[slice, ...],
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """``fp8 * scale`` of the slice ``slices`` of a block-scaled weight, in float32, then ``dtype``."""
    (r, c), (br, bc) = (s.start or 0 for s in slices), block
    rows, cols = tensor.shape
    s = scale[r // br : -(-(r + rows) // br), c // bc : -(-(c + cols) // bc)]
    s = s.repeat_interleave(br, 0).repeat_interleave(bc, 1)[r % br : r % br + rows, c % bc : c % bc + cols]
    return (tensor.float() * s).to(dtype)


def check_fp8(ckpt: SafetensorsDir, keys: list[str], block: tuple[int, int]) -> None:
    """Every FP8 weight of ``keys`` has its scales, of the shape its blocks need (else one error naming the key)."""
    for key in keys:
        if key + SCALE_SUFFIX not in ckpt:
            raise CheckpointError(
                f"{key} is stored as {ckpt.info(key).dtype} without {key + SCALE_SUFFIX}: FP8 weights load only "
                "with their block scales (DeepSeek's weight_scale_inv); use the checkpoint's bf16 release or restore "
                "the scale tensors"
            )
        _check_scale_shape(ckpt, key, block)
