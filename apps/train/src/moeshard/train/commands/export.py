"""``moeshard-train export-hf``: a training checkpoint (any layout) → a Hub-layout folder transformers loads."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moeshard import checkpoint as ckpt
from moeshard.train.config import config_from_dict

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


def _read_run(src: Path):
    """``(job config, model config, DCP metadata of every stored tensor)`` of a complete moeshard-train checkpoint.

    Raises:
        ValueError: ``src`` is not one (no ``COMPLETE``, no ``extra.json``).
    """
    from moeshard.train.config import resolve_model_config

    ckpt.read_marker(src)
    extra = ckpt.read_extra(src)  # JSON (or an older checkpoint's extra.pt, weights_only)
    cfg = config_from_dict(extra["config"])
    # The model config saved with the checkpoint: the run's model.path may be gone by now.
    if "model_config" in extra:  # the family from the saved config's model_type (runs of 0.3 and earlier: Qwen3-MoE)
        from moeshard.train.families import get_family

        family = get_family(extra["model_config"].get("model_type", "qwen3_moe"))
        mcfg = family.hf_format.config_class.from_dict(extra["model_config"])
    else:
        mcfg = resolve_model_config(cfg)
    return cfg, mcfg, dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata


def load_full_model(checkpoint: str | Path):
    """A training checkpoint (any layout) as one full, unsharded model on the CPU, in one process.

    Returns:
        ``(model, job_config)``: the family's causal LM in float32 and the run's configuration.

    Raises:
        ValueError: ``checkpoint`` is not a complete moeshard-train checkpoint.
    """
    from moeshard.train.families import family_of

    src = Path(checkpoint)
    cfg, mcfg, stored = _read_run(src)
    model = family_of(mcfg).model_class(mcfg)
    if any(k.startswith("model.") and k.endswith(".mlp.gate.bias") for k in stored):
        model.enable_router_bias()  # train.router_bias: the selection biases are part of the trained model
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(src), no_dist=True)  # global-shape keys: independent of the saving layout
    model.load_state_dict(state["model"], strict=True)
    return model, cfg


def export_hf(
    checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16", max_shard_size: str | int = "5GB"
) -> Path:
    """Write ``config.json``, per-expert safetensors shards + index (and the run's tokenizer files) to ``out``,
    streaming from the checkpoint's DCP files: each output shard reads only the tensors it is cut from, so host
    memory is bounded by one shard (plus a fused expert tensor spanning two), not the model.

    Args:
        dtype: of the floating-point tensors written (``bfloat16``, ``float16``, ``float32``, or ``keep``: the
            checkpoint's, float32 for moeshard-train runs).
        max_shard_size: bytes per safetensors file (``"5GB"``, ``"500MB"``, an int).

    Raises:
        ValueError: ``checkpoint`` is not a complete checkpoint, ``out`` exists and is not empty, a bad dtype.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moeshard.models.common import stream_hf_weights
    from moeshard.train.families import family_of

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "keep": None}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(dtypes)}")
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"--out {dst} exists and is not empty; nothing was overwritten. Choose a new folder")
    src = Path(checkpoint)
    cfg, mcfg, stored = _read_run(src)
    fmt = family_of(mcfg).hf_format
    with torch.device("meta"):
        model = family_of(mcfg).model_class(mcfg)
    # The HF tensors, in model order: parameters and the buffers the format stores (DeepSeek-V3's correction bias).
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n.endswith(fmt.buffers)]
    specs = {}
    for name in names:
        md = stored.get(f"model.{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{src} holds no tensor model.{name}: it is not a checkpoint of this model")
        specs[name] = (tuple(md.size), md.properties.dtype)
    if any(k.startswith("model.") and k.endswith(".mlp.gate.bias") for k in stored):
        warnings.warn(
            "the routers' selection bias (train.router_bias) is not exported: transformers' Qwen3-MoE has no such "
            "tensor, so the exported model routes without it (DeepSeek-V3's e_score_correction_bias is exported)",
            stacklevel=2,
        )

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        state = {"model": {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in keys}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(src), no_dist=True)  # reads only these tensors' bytes
        return state["model"]

    stream_hf_weights(specs, read, mcfg, dst, max_shard_size=max_shard_size, dtype=dtypes[dtype], fmt=fmt)
    tokenizer = cfg.data.tokenizer  # absolute since moeshard-train 0.3 (checkpoint.job_state)
    if tokenizer and not Path(tokenizer).is_dir():
        warnings.warn(
            f"the run's tokenizer folder {tokenizer} is not there (a relative path of an older run, or moved): the "
            "export has no tokenizer files; copy them in yourself",
            stacklevel=2,
        )
    elif tokenizer:
        for name in _TOKENIZER_FILES:
            f = Path(tokenizer) / name
            if f.is_file():
                shutil.copy2(f, dst / name)
    return dst
