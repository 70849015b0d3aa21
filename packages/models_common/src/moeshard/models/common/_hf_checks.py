"""The checks :func:`moeshard.models.common.load_hf_weights` makes before the first byte is read: every key the
model needs is there and none it does not have (:func:`check_keys`), every dtype cast is one that is done
(:func:`check_dtypes`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from moeshard.models.common._fp8 import FP8
from moeshard.models.common._safetensors import CheckpointError, SafetensorsDir


def check_dtypes(ckpt: SafetensorsDir, requests: list[Any], fp8: set[str], allow_dtype_cast: bool) -> dict[str, int]:
    """``"src->dst"`` → tensors cast (FP8 dequantisation counted as a cast); raises for a cast that is not done.
    ``requests``: the load's, each with ``.key`` (in the checkpoint) and ``.dst`` (the parameter's region)."""
    cast_of: dict[str, str] = {}
    for req in requests:
        src, dst = ckpt.info(req.key).dtype, req.dst.dtype
        if req.key in fp8:
            if not dst.is_floating_point or dst in FP8:
                raise CheckpointError(f"{req.key} is FP8: it dequantises into a float parameter, not {dst}")
            cast_of[req.key] = f"{_name(src)}->{_name(dst)}"
        elif src != dst:
            if not (allow_dtype_cast and src.is_floating_point and dst.is_floating_point):
                raise CheckpointError(
                    f"{req.key} is stored as {src}, the parameter is {dst}: "
                    + ("pass allow_dtype_cast=True" if src.is_floating_point and dst.is_floating_point else "")
                    + " (only float-to-float casts are done; convert the checkpoint or the model's dtype)"
                )
            cast_of[req.key] = f"{_name(src)}->{_name(dst)}"
    return dict(Counter(cast_of.values()))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_keys(path: Path, expected: set[str], found: set[str]) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    problems = []
    if missing:
        problems.append(
            f"is missing {len(missing)} tensor(s) the model needs, e.g. {missing[:5]} (the checkpoint is incomplete: "
            "copy every shard; or it was saved from a different config)"
        )
    if unexpected:
        problems.append(
            f"has {len(unexpected)} tensor(s) this model does not have, e.g. {unexpected[:5]} (saved from a different "
            "architecture or config, or a layer's experts stored both fused and per expert: remove them or load a "
            "matching checkpoint)"
        )
    if problems:
        raise CheckpointError(f"checkpoint {path} " + "; and it ".join(problems))
