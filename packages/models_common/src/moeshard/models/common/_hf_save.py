"""Saving a model of a family as a HF checkpoint that transformers (and :func:`load_hf_weights`) loads.

Layout of the directory: ``config.json``, ``model.safetensors`` or ``model-0000i-of-0000N.safetensors`` shards
of at most ``max_shard_size`` bytes plus ``model.safetensors.index.json``. Experts are written per expert by
default (``model.layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight``, the Hub's layout, which
transformers 5.x fuses on load), or fused.

The new checkpoint is written into a hidden sibling directory and swapped in by two renames, so a crash never
leaves a half-written checkpoint under the target name; files there that are not weights or config (tokenizer,
generation config, ...) are carried over.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from moeshard.models.common._hf_load import HFFormat, _clean_fqn, _tensors, model_format
from moeshard.models.common._safetensors import INDEX_NAME

__all__ = ["EXPERT_LAYOUTS", "parse_size", "save_hf_checkpoint", "save_hf_weights", "stream_hf_weights"]

EXPERT_LAYOUTS = ("per_expert", "fused")
"""Values of ``expert_layout``: one tensor per expert and projection (the Hub's keys) or the fused tensors."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"`` (10^9) or ``"500MiB"`` (2^20), as transformers reads them."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
        if not match:
            raise ValueError(f"max_shard_size={size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
        value = int(float(match[1]) * _UNITS[match[2] or ""])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _expand(state: Mapping[str, torch.Tensor], expert_layout: str, fmt: HFFormat) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint key → tensor: a tensor the format stores in another layout in that layout
    (``HFFormat.stored``), fused expert tensors split per expert when asked."""
    for fqn, tensor in state.items():
        stored = fmt.stored.to_stored(fqn, tensor) if fmt.stored is not None else None
        if stored is not None:
            yield from stored.items()
            continue
        prefix, _, name = fqn.rpartition(".")
        if expert_layout == "fused" or not prefix.endswith(".mlp.experts") or name not in ("gate_up_proj", "down_proj"):
            yield fqn, tensor
            continue
        for e in range(tensor.shape[0]):
            if name == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_file_mode(folder: Path) -> int:
    """The permission bits a new file in ``folder`` gets (0666 less the umask, any default ACL applied): probed
    with a file rather than set by ``os.umask``, which would change it for every thread of the process."""
    probe = folder / f".mode-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.unlink(probe)


def _is_ours(name: str) -> bool:
    return name in ("config.json", INDEX_NAME) or name.endswith(".safetensors")


def save_hf_weights(
    state: Mapping[str, torch.Tensor],
    config: PretrainedConfig,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    expert_layout: str = "per_expert",
    dtype: torch.dtype | None = None,
    fmt: HFFormat,
) -> list[Path]:
    """Write full tensors (our FQNs, fused experts ``[E, ...]``) and ``config`` as a HF checkpoint directory.

    Args:
        state: FQN → complete, plain tensor (any device; copied to CPU one shard at a time).
        config: the model's config; ``config.json`` gets ``architectures`` and ``dtype`` filled in.
        path: the directory to create or replace.
        max_shard_size: bytes per shard (int or ``"5GB"``); a larger single tensor gets a shard of its own.
        expert_layout: ``"per_expert"`` (the Hub's keys, default) or ``"fused"``; tensors the format stores in
            a layout of its own (``HFFormat.stored``) are written in that layout either way.
        dtype: cast floating-point tensors to this dtype (default: keep each tensor's).
        fmt: the model family's format (its ``architectures`` name in ``config.json``).

    Returns:
        The weight files written, in order.
    """
    for key, tensor in state.items():
        if isinstance(tensor, DTensor) or tensor.device.type == "meta":
            raise ValueError(f"{key} is a DTensor or on meta: save_hf_weights needs full, materialised tensors")
    specs = {key: (tuple(t.shape), t.dtype) for key, t in state.items()}
    return stream_hf_weights(
        specs,
        lambda keys: {k: state[k] for k in keys},
        config,
        path,
        max_shard_size=max_shard_size,
        expert_layout=expert_layout,
        dtype=dtype,
        fmt=fmt,
    )


def _out_dtype(src: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src.is_floating_point else src


def _plan(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    expert_layout: str,
    dtype: torch.dtype | None,
    fmt: HFFormat,
) -> Iterator[tuple[str, str, int]]:
    """``(output key, source key, bytes)`` in writing order; fused experts expand per expert (see ``_expand``)."""
    for fqn, (shape, src_dtype) in specs.items():
        meta = torch.empty(shape, dtype=_out_dtype(src_dtype, dtype), device="meta")
        for key, part in _expand({fqn: meta}, expert_layout, fmt):
            yield key, fqn, part.numel() * part.element_size()


def stream_hf_weights(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    read: Callable[[list[str]], Mapping[str, torch.Tensor]],
    config: PretrainedConfig,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    expert_layout: str = "per_expert",
    dtype: torch.dtype | None = None,
    fmt: HFFormat,
) -> list[Path]:
    """:func:`save_hf_weights` from tensors read a shard at a time: host memory is bounded by one output shard
    plus the source tensors it is cut from (a fused expert tensor spanning two shards is read once and kept until
    both are written), not by the model.

    Args:
        specs: FQN → ``(shape, dtype)`` of every full tensor, in writing order (e.g. a checkpoint's metadata).
        read: given FQNs, their full tensors (e.g. a partial distributed-checkpoint load); called once per shard
            with the FQNs that shard needs and that are not held from the previous shard.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r}; choose one of {EXPERT_LAYOUTS}")
    limit = parse_size(max_shard_size)
    shards: list[list[tuple[str, str]]] = [[]]
    size = 0
    for key, src, nbytes in _plan(specs, expert_layout, dtype, fmt):
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, src))
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; choose a directory path for the checkpoint")
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    stage = path.parent / f".{path.name}.saving-{token}"
    stage.mkdir()
    try:
        mode = _new_file_mode(stage)
        weight_map, total_bytes, total_params = {}, 0, 0
        held: dict[str, torch.Tensor] = {}
        for i, (name, shard) in enumerate(zip(names, shards)):
            needed = list(dict.fromkeys(src for _, src in shard))
            missing = [k for k in needed if k not in held]
            held.update({k: v.detach() for k, v in read(missing).items()} if missing else {})
            parts = dict(_expand({k: held[k] for k in needed}, expert_layout, fmt))
            # Contiguous CPU copies in the output dtype: per-expert views share storage, which safetensors refuses.
            tensors = {
                key: parts[key].to("cpu", _out_dtype(parts[key].dtype, dtype), copy=True).contiguous()
                for key, _ in shard
            }
            save_file(tensors, stage / name, metadata={"format": "pt"})
            # safetensors creates its files 0600 (readable by their owner only); give them a new file's mode, as
            # config.json gets. Still inside the staging folder: the rename below publishes them all at once.
            os.chmod(stage / name, mode)
            _fsync(stage / name)
            for key, t in tensors.items():
                weight_map[key] = name
                total_bytes += t.numel() * t.element_size()
                total_params += t.numel()
            del tensors, parts
            following = {src for _, src in shards[i + 1]} if i + 1 < n else set()
            held = {k: v for k, v in held.items() if k in following}
        if n > 1:
            index = {
                "metadata": {"total_size": total_bytes, "total_parameters": total_params},
                "weight_map": weight_map,
            }
            (stage / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        out_dtypes = [_out_dtype(d, dtype) for _, d in specs.values()]
        _write_config(config, fmt, out_dtypes, stage / "config.json")
        if path.exists():
            for item in path.iterdir():
                if not _is_ours(item.name):
                    _carry(item, stage / item.name)
            old = path.parent / f".{path.name}.old-{token}"
            os.rename(path, old)
            os.rename(stage, path)
            shutil.rmtree(old)
        else:
            os.rename(stage, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return [path / name for name in names]


def _carry(src: Path, dst: Path) -> None:
    """Hard-link (or copy) a file or tree that belongs to the old checkpoint but is not ours to rewrite."""
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _write_config(config: PretrainedConfig, fmt: HFFormat, tensor_dtypes: list[torch.dtype], file: Path) -> None:
    config = copy.deepcopy(config)
    config.architectures = [fmt.architecture]
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the weights are written dequantised (FP8 checkpoints load that way)
    dtypes = [d for d in tensor_dtypes if d.is_floating_point]
    if dtypes:
        config.dtype = max(set(dtypes), key=dtypes.count)
    config.to_json_file(file, use_diff=False)
    _fsync(file)


def save_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    expert_layout: str = "per_expert",
) -> list[Path]:
    """Save a plain (unsharded, all experts) model with :func:`save_hf_weights`.

    Raises:
        ValueError: the model is sharded (DTensor parameters, EP-sliced or range-loaded experts): gather full
            tensors first (e.g. ``moeshard.fsdp_moe.get_state_dict`` + ``full_tensor()``), then call
            ``save_hf_weights``.
    """
    config, fmt = model.config, model_format(model)
    state = {}
    for raw_fqn, param in _tensors(model, fmt):
        fqn = _clean_fqn(raw_fqn)
        # An EP slice holds fewer than the config's experts, as a range-loaded model does.
        partial_experts = fqn.endswith(("experts.gate_up_proj", "experts.down_proj")) and (
            param.shape[0] != fmt.num_experts(config)
        )
        if isinstance(param, DTensor) or partial_experts:
            raise ValueError(
                f"{fqn} is sharded (DTensor, EP slice or expert range): save_pretrained needs the whole model in "
                "one process; gather full tensors (e.g. moeshard.fsdp_moe.get_state_dict and full_tensor()) on "
                "one rank and call save_hf_weights(state, config, path)"
            )
        state[fqn] = param.detach()
    return save_hf_weights(state, config, path, max_shard_size=max_shard_size, expert_layout=expert_layout, fmt=fmt)
