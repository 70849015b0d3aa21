"""``moeshard-train export-hf``: a training checkpoint (any layout) → a Hub-layout folder transformers loads, with
the tokenizer and the generation config beside the weights.

What an export reads from a checkpoint's ``extra`` (``moeshard.checkpoint.save_checkpoint``'s JSON state):
``model_config`` (the transformers config as a dict; required unless ``config`` names the model), ``config`` (this
app's job config, optional), ``model_path`` (the local Hub folder the weights started from, absolute, optional) and
``tokenizer`` (the run's tokenizer folder, absolute, optional). moeshard-train writes all four; a loop of one's own
(``examples/custom_trainer.py``) writes what it has.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import GenerationConfig

from moeshard import checkpoint as ckpt
from moeshard.lora import LoraAdapters, LoraOptions, apply_lora, merged_weights, save_adapter
from moeshard.models.common import stream_hf_weights
from moeshard.train.config import JobConfig, config_from_dict, resolve_model_config
from moeshard.train.families import family_of, get_family

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of a tokenizer folder an export copies (those present)."""
_TOKENIZER_CORE = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a folder with one of these holds a tokenizer
GENERATION_CONFIG = "generation_config.json"


def holds_tokenizer(folder: str | Path | None) -> bool:
    """Whether ``folder`` is a local folder with tokenizer files (``tokenizer.json``, ``tokenizer.model`` or
    ``vocab.json``)."""
    return folder is not None and any((Path(folder) / name).is_file() for name in _TOKENIZER_CORE)


def _prepared_tokenizer(cfg: JobConfig) -> str | None:
    """The tokenizer folder recorded in the header of a prepared data folder of the run (``moeshard.data``'s token
    format: ``header.json`` ``tokenizer.path``, absolute), the first that is there."""
    paths = [p for src in cfg.data.source_list() for p in ((src.path,) if isinstance(src.path, str) else src.path)]
    for path in paths:
        try:
            header = json.loads((Path(path) / "header.json").read_text())
        except (OSError, ValueError):  # a raw file, a glob, a moved folder: nothing recorded here
            continue
        folder = (header.get("tokenizer") or {}).get("path") if isinstance(header, dict) else None
        if holds_tokenizer(folder):
            return str(folder)
    return None


def find_tokenizer(cfg: JobConfig | None, model_path: str | None) -> tuple[str | None, str]:
    """The run's tokenizer folder (absolute) and where it was found, or ``(None, why there is none)``.

    In order: ``data.tokenizer``; the tokenizer a prepared data folder was made with (its header); ``model.path``
    when it holds tokenizer files.
    """
    if cfg is not None and cfg.data.tokenizer:
        folder = os.path.abspath(os.path.expanduser(cfg.data.tokenizer))
        if holds_tokenizer(folder):
            return folder, "data.tokenizer"
        return None, f"data.tokenizer {folder} holds no tokenizer files (moved?)"
    if cfg is not None and (folder := _prepared_tokenizer(cfg)):
        return folder, "the prepared data's header"
    if holds_tokenizer(model_path):
        return os.path.abspath(model_path), "model.path"
    return None, "the run names none (data.tokenizer, prepared data, or a model.path with tokenizer files)"


class _Run:
    """What a checkpoint says about its run: job config (None for a loop of one's own), model config, the stored
    tensors' metadata, the Hub folder the weights started from, the tokenizer folder and the LoRA options (None
    where every weight trained)."""

    def __init__(self, src: Path) -> None:
        ckpt.read_marker(src)
        extra = ckpt.read_extra(src)  # JSON (or an older checkpoint's extra.pt, weights_only)
        self.cfg: JobConfig | None = config_from_dict(extra["config"]) if "config" in extra else None
        # The model config saved with the checkpoint: the run's model.path may be gone by now.
        if "model_config" in extra:  # the family from its model_type (runs of 0.3 and earlier: Qwen3-MoE)
            family = get_family(extra["model_config"].get("model_type", "qwen3_moe"))
            self.model_config = family.hf_format.config_class.from_dict(extra["model_config"])
        elif self.cfg is not None:
            self.model_config = resolve_model_config(self.cfg)
        else:
            raise ValueError(
                f"{src} records no model config: its extra (save_checkpoint's JSON state) needs 'model_config', the "
                "model's transformers config as a dict; save with extra={'step': step, 'model_config': "
                "config.to_dict()}"
            )
        self.stored = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
        # A LoRA run: the app's config says so; a loop of one's own records its LoraOptions as a dict in extra.
        lora = self.cfg.lora if self.cfg is not None else LoraOptions.from_dict(extra.get("lora") or {})
        self.lora: LoraOptions | None = lora if lora.enabled else None
        if self.lora is None and self.cfg is None and any(".lora_A" in k for k in self.stored):
            raise ValueError(
                f"{src} holds LoRA adapters but its extra records no 'lora': save with extra={{..., 'lora': "
                "dataclasses.asdict(lora_options)}} (the LoraOptions the loop applied)"
            )
        model_path = extra.get("model_path") or (self.cfg.model.path if self.cfg is not None else None)
        self.model_path: str | None = os.path.abspath(model_path) if model_path else None
        if "tokenizer" in extra:  # found when the run started, where its relative paths still meant something
            folder, where = extra["tokenizer"]["path"], extra["tokenizer"]["from"]
            if folder is not None and not holds_tokenizer(folder):
                folder, where = None, f"the run's tokenizer folder {folder} is gone (moved?)"
            self.tokenizer: tuple[str | None, str] = (folder, where)
        else:  # an older run, or a loop of one's own: what its config and model folder say now
            self.tokenizer = find_tokenizer(self.cfg, self.model_path)


def load_full_model(checkpoint: str | Path):
    """A training checkpoint (any layout) as one full, unsharded model on the CPU, in one process.

    Returns:
        ``(model, job_config)``: the family's causal LM in float32 and the run's configuration (None for a
        checkpoint of a loop of one's own).

    Raises:
        ValueError: ``checkpoint`` is not a complete moeshard-train checkpoint.
    """
    src = Path(checkpoint)
    run = _Run(src)
    model = family_of(run.model_config).model_class(run.model_config)
    if any(k.startswith("model.") and k.endswith(".mlp.gate.bias") for k in run.stored):
        model.enable_router_bias()  # train.router_bias: the selection biases are part of the trained model
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(src), no_dist=True)  # global-shape keys: independent of the saving layout
    model.load_state_dict(state["model"], strict=True)
    return model, run.cfg


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    dtype: str = "bfloat16",
    max_shard_size: str | int = "5GB",
    say: Callable[[str], None] = print,
    merge_lora: bool = False,
) -> Path:
    """Write ``config.json``, per-expert safetensors shards + index, the run's tokenizer files and
    ``generation_config.json`` to ``out``, streaming from the checkpoint's DCP files: each output shard reads only
    the tensors it is cut from, so host memory is bounded by one shard (plus a fused expert tensor spanning two),
    not the model. The folder appears whole (written beside ``out``, then renamed); its files get the umask's mode.

    The tokenizer: the run's (:func:`find_tokenizer`); the generation config: ``model.path``'s, else one built from
    the model config's bos/eos/pad ids. Where either is missing, ``say`` gets one line saying why and how to add it.

    Args:
        dtype: of the floating-point tensors written (``bfloat16``, ``float16``, ``float32``, or ``keep``: the
            checkpoint's, float32 for moeshard-train runs).
        max_shard_size: bytes per safetensors file (``"5GB"``, ``"500MB"``, an int).
        say: where the lines on a missing tokenizer or generation config go.
        merge_lora: a LoRA run's checkpoint: the base (its ``model.path``, read whole into host memory) with the
            adapters merged (``moeshard.lora.merged_weights``). Without it such a checkpoint gives its adapter in
            PEFT's format (:func:`export_adapter`), with a line on ``--merge-lora``.

    Raises:
        ValueError: ``checkpoint`` is not a complete checkpoint (or records no model config), ``out`` exists and is
            not empty, a bad dtype.
    """
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "keep": None}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(dtypes)}")
    dst = Path(out)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"--out {dst} exists and is not an empty folder; nothing was overwritten. Choose a new folder")
    src = Path(checkpoint)
    run = _Run(src)
    mcfg = run.model_config
    fmt = family_of(mcfg).hf_format
    lora = run.lora
    if lora is not None and not merge_lora:  # a LoRA run's checkpoint holds its adapters, not the base
        export_adapter(src, dst)
        say(f"{dst}: a LoRA run's adapter in PEFT's format; pass --merge-lora for the base with it merged")
        return dst
    if merge_lora and lora is None:
        raise ValueError(f"--merge-lora: {src} is not a checkpoint of a LoRA run (its config has lora.rank 0)")
    if lora is not None:
        specs, read = _merged(src, run, lora)
    else:
        specs, read = _stored(src, run, fmt)

    # Written beside --out and renamed into place when complete: a crash leaves no folder that looks like an export.
    stage = dst.parent / f".{dst.name}.exporting-{uuid.uuid4().hex[:8]}"
    try:
        stream_hf_weights(specs, read, mcfg, stage, max_shard_size=max_shard_size, dtype=dtypes[dtype], fmt=fmt)
        for missing in (_add_tokenizer(stage, run.tokenizer), _add_generation_config(stage, mcfg, run.model_path)):
            if missing:
                say(f"{dst}: {missing}")
        os.replace(stage, dst)  # over an empty folder, or none
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return dst


def _add_tokenizer(folder: Path, found: tuple[str | None, str]) -> str | None:
    """Copies the tokenizer's files into ``folder``; returns why it cannot when there is none."""
    tokenizer, where = found
    if tokenizer is None:
        return f"no tokenizer: {where}; set data.tokenizer=DIR (a local folder) or copy its files in"
    for name in TOKENIZER_FILES:
        if (Path(tokenizer) / name).is_file():
            shutil.copyfile(Path(tokenizer) / name, folder / name)  # a new file: the umask's mode, not the source's
    return None


def _add_generation_config(folder: Path, model_config: Any, model_path: str | None) -> str | None:
    """Writes ``model.path``'s ``generation_config.json`` (the sampling defaults a chat model ships with), else one
    made from the model config's token ids, into ``folder``; returns why it cannot when there are none."""
    source = Path(model_path) / GENERATION_CONFIG if model_path else None
    if source is not None and source.is_file():
        shutil.copyfile(source, folder / GENERATION_CONFIG)
        return None
    ids = {k: getattr(model_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if all(v is None for v in ids.values()):
        return (
            "no generation_config.json: the model config sets no bos/eos/pad token id; set them "
            "(--model.overrides.eos_token_id=N) or add the file"
        )
    GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(folder)
    return None


def _stored(src: Path, run: _Run, fmt: Any) -> tuple[dict[str, Any], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """The Hub tensors of a full checkpoint: their shapes and dtypes, and a reader of some of them from its files."""
    mcfg, stored = run.model_config, run.stored
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
            stacklevel=3,
        )
    return specs, functools.partial(_read, src, specs)


def _read(src: Path, specs: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    state = {"model": {k: torch.empty(specs[k][0], dtype=specs[k][1]) for k in keys}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(src), no_dist=True)  # reads only these tensors' bytes
    return state["model"]


def _adapters(src: Path, run: _Run, lora: LoraOptions) -> tuple[LoraAdapters, dict[str, torch.Tensor]]:
    """The LoRA adapters of a LoRA run's checkpoint (full, float32) and what they target."""
    with torch.device("meta"):
        model = family_of(run.model_config).model_class(run.model_config)
    adapters = apply_lora(model, lora)
    specs = {}
    for name in adapters.names():
        md = run.stored.get(f"model.{name}")
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{src} holds no adapter model.{name}: it is not a checkpoint of this LoRA run")
        specs[name] = (tuple(md.size), md.properties.dtype)
    return adapters, _read(src, specs, list(specs))


def export_adapter(checkpoint: str | Path, out: str | Path) -> Path:
    """A LoRA run's checkpoint (any layout) as a PEFT adapter folder (``adapter_config.json``,
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads over the base model.

    Raises:
        ValueError: ``checkpoint`` is not a complete checkpoint of a LoRA run.
    """
    src = Path(checkpoint)
    run = _Run(src)
    if run.lora is None:
        raise ValueError(f"{src} is not a checkpoint of a LoRA run (its config has lora.rank 0): use export-hf")
    adapters, tensors = _adapters(src, run, run.lora)
    base = run.model_path or (run.cfg.model.preset if run.cfg is not None else None)
    model_class = type(run.model_config).__name__.replace("Config", "ForCausalLM")
    return save_adapter(out, adapters, tensors, base_model=base, model_class=model_class)


def _merged(src: Path, run: _Run, lora: LoraOptions) -> tuple[dict[str, Any], Callable[[list[str]], dict]]:
    """The Hub tensors of a LoRA run: its base (``model.path``, whole in host memory) with the adapters merged."""
    if run.model_path is None or not Path(run.model_path).is_dir():
        raise ValueError(
            f"--merge-lora: the run of {src} started from "
            f"{run.model_path or 'a preset (model.path null)'}, which is not a folder here: the base weights to "
            "merge into are missing; export the adapter (export-hf without --merge-lora) and merge it over the base"
        )
    adapters, tensors = _adapters(src, run, lora)
    model = family_of(run.model_config).model_class.from_pretrained(run.model_path, dtype=torch.float32)
    fmt = family_of(run.model_config).hf_format
    state = dict(model.named_parameters())
    state.update({n: b for n, b in model.named_buffers() if n.endswith(fmt.buffers)})
    state = {n: t.detach() for n, t in state.items()}
    state.update(merged_weights(adapters, state, tensors))
    specs = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    return specs, lambda keys: {k: state[k] for k in keys}
