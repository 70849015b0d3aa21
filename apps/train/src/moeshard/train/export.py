"""``moeshard-train export-hf``: a training checkpoint (any layout) → a Hub-layout folder transformers loads."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moeshard.train import checkpoint as ckpt
from moeshard.train.config import JobConfig, _section_from_dict

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def _job_config(raw: dict) -> JobConfig:
    import typing

    hints = typing.get_type_hints(JobConfig)
    return JobConfig(**{k: _section_from_dict(hints[k], k, v) for k, v in raw.items()})


def load_full_model(checkpoint: str | Path):
    """A training checkpoint (any layout) as one full, unsharded model on the CPU, in one process.

    Returns:
        ``(model, job_config)``: our ``Qwen3MoeForCausalLM`` in float32 and the run's configuration.

    Raises:
        ValueError: ``checkpoint`` is not a complete moeshard-train checkpoint.
    """
    from transformers import Qwen3MoeConfig

    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM
    from moeshard.train.config import resolve_model_config

    src = Path(checkpoint)
    ckpt.read_marker(src)
    if not (src / "extra.pt").is_file():
        raise ValueError(f"{src} has no extra.pt: it is not a moeshard-train checkpoint")
    extra = torch.load(src / "extra.pt", weights_only=False)
    cfg = _job_config(extra["config"])
    # The model config saved with the checkpoint: the run's model.path may be gone by now.
    mcfg = Qwen3MoeConfig.from_dict(extra["model_config"]) if "model_config" in extra else resolve_model_config(cfg)
    model = Qwen3MoeForCausalLM(mcfg)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(src), no_dist=True)  # global-shape keys: independent of the saving layout
    model.load_state_dict(state["model"], strict=True)
    return model, cfg


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Write ``config.json``, per-expert safetensors shards + index (and the run's tokenizer files) to ``out``.

    Raises:
        ValueError: ``checkpoint`` is not a complete checkpoint, or ``out`` exists and is not empty.
    """
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"--out {dst} exists and is not empty; nothing was overwritten. Choose a new folder")
    model, cfg = load_full_model(checkpoint)
    model.save_pretrained(dst)
    if cfg.data.tokenizer:
        for name in _TOKENIZER_FILES:
            f = Path(cfg.data.tokenizer) / name
            if f.is_file():
                shutil.copy2(f, dst / name)
    return dst
