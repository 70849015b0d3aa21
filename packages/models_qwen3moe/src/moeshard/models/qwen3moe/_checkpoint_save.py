"""Saving Qwen3-MoE as a HF checkpoint: the shared writer (``moeshard.models.common``) with Qwen3-MoE's format."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig

from moeshard.models.common import save_hf_checkpoint
from moeshard.models.common import save_hf_weights as _save_hf_weights
from moeshard.models.common import stream_hf_weights as _stream_hf_weights
from moeshard.models.qwen3moe._checkpoint import QWEN3_FORMAT

__all__ = ["save_hf_checkpoint", "save_hf_weights", "stream_hf_weights"]


def save_hf_weights(
    state: Mapping[str, torch.Tensor], config: Qwen3MoeConfig, path: str | os.PathLike, **kw
) -> list[Path]:
    """``moeshard.models.common.save_hf_weights`` of a Qwen3-MoE state (``max_shard_size``, ``expert_layout``,
    ``dtype`` as there)."""
    return _save_hf_weights(state, config, path, fmt=QWEN3_FORMAT, **kw)


def stream_hf_weights(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    read: Callable[[list[str]], Mapping[str, torch.Tensor]],
    config: Qwen3MoeConfig,
    path: str | os.PathLike,
    **kw,
) -> list[Path]:
    """``moeshard.models.common.stream_hf_weights`` of a Qwen3-MoE state, a shard at a time."""
    return _stream_hf_weights(specs, read, config, path, fmt=QWEN3_FORMAT, **kw)
