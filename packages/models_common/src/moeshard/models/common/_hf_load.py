"""Loading HF checkpoints of a model family into a model in place, whatever its parameters have become.

The family's :class:`HFFormat` (the model class's ``hf_format``) says what its checkpoints hold beyond the common
layout: its ``model_type``, the config fields that decide shapes, stored buffers, layers to skip.

A parameter may be a plain tensor, an EP-sliced expert tensor (``moeshard.ep.apply_ep``: its experts are
``[expert_start, expert_end)`` of the global ones, from the ``EPInfo`` that ``apply_ep`` returned), or a DTensor from FSDP2 (its
local shard is a box of the DTensor's global shape, from ``_torch_internals.shard_offset``). For an
expert parameter after EP + FSDP, the DTensor's global shape is the EP-local one, so the box is shifted by
``expert_start`` on dim 0. Each rank reads exactly its box, from either expert layout:

- fused (transformers 5.x in memory): ``...mlp.experts.gate_up_proj [E, 2F, D]``, ``...mlp.experts.down_proj
  [E, D, F]``;
- per expert (the Hub): ``...mlp.experts.{e}.gate_proj.weight [F, D]``, ``up_proj.weight [F, D]``,
  ``down_proj.weight [D, F]``; the box of ``gate_up_proj`` is split between the gate and up tensors.

The whole plan (keys, shapes, dtypes) is checked against the checkpoint before the first byte is written.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PretrainedConfig

from moeshard.ep import EPInfo
from moeshard.models.common._fp8 import FP8, SCALE_SUFFIX, check_fp8, dequantize, fp8_block, read_scales
from moeshard.models.common._hf_checks import check_dtypes, check_keys
from moeshard.models.common._safetensors import CheckpointError, SafetensorsDir
from moeshard.models.common._torch_internals import shard_offset

__all__ = [
    "CheckpointError",
    "FolderLayout",
    "HFFormat",
    "LoadReport",
    "StoredLayout",
    "load_hf_config",
    "load_hf_weights",
    "local_region",
]

logger = logging.getLogger(__name__)

_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
# Segments that wrappers (activation checkpointing, torch.compile, FSDP1) insert into FQNs.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _no_layers(config: PretrainedConfig) -> range:
    """No layer is skipped (the default of ``HFFormat.skipped_layers``)."""
    return range(0)


def _config_field(config: PretrainedConfig, name: str) -> object:
    """``getattr(config, name, None)`` (the default of ``HFFormat.field``)."""
    return getattr(config, name, None)


@dataclass(frozen=True)
class FolderLayout:
    """Another kind of folder that holds a family's model inside a larger one (a vision-language checkpoint whose
    language model is the family's): the loader reads the model from it and leaves the rest out.

    Attributes:
        model_type: the ``model_type`` of such a folder's ``config.json``.
        config_key: the entry of that ``config.json`` holding the model's own config (``"text_config"``).
        prefix: ``(ours, stored)``: our keys ``ours…`` are stored as ``stored…`` (``("model.",
            "model.language_model.")``); other keys are stored as they are.
        skipped: ``(stored prefix, what it is)`` of the parts the model does not build, each left out with one
            logged line (``("model.visual.", "the vision tower")``).
    """

    model_type: str
    config_key: str
    prefix: tuple[str, str]
    skipped: tuple[tuple[str, str], ...] = ()


class StoredLayout(Protocol):
    """Parameters a family's checkpoints store in another layout than the model's (transposed, rows reordered,
    quantised): the loader reads each such parameter's stored tensors for this rank's rows of dim 0 only (its
    experts, for an expert tensor) and converts them; the writer writes the stored layout back.

    Contract: every stored tensor of a parameter keeps the parameter's dim 0 (a rank's rows ``[a, b)`` of the
    parameter come from rows ``[a, b)`` of each stored tensor), so no rank ever reads another rank's experts.
    """

    def stored_keys(self, fqn: str, shape: tuple[int, ...], found: Set[str]) -> dict[str, tuple[int, ...]] | None:
        """Stored key -> full stored shape of the tensors that hold parameter ``fqn`` (global shape ``shape``) in a
        checkpoint holding the keys ``found``; None where ``fqn`` is stored as it is."""
        ...

    def from_stored(self, fqn: str, stored: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``fqn``'s rows in the model's layout and ``dtype`` from its stored tensors (keys of :meth:`stored_keys`),
        each cut to the same rows of dim 0."""
        ...

    def to_stored(self, fqn: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Stored key -> tensor to write for parameter ``fqn`` (unquantised; works on the meta device too); None
        where ``fqn`` is written as it is."""
        ...


@dataclass(frozen=True)
class HFFormat:
    """What one model family's HF checkpoints look like: the loader and writer read it from the model class
    (``type(model).hf_format``) or are given it.

    Attributes:
        model_type: the ``model_type`` of its ``config.json``.
        architecture: written to ``config.json``'s ``architectures``.
        config_class: the transformers config class.
        check_config: raises ``ValueError`` for a config the model does not implement.
        structural_keys: config fields that decide parameter shapes (a checkpoint that differs is refused by name).
        num_experts: routed experts per MoE layer of a config.
        buffers: name suffixes of persistent buffers the format stores (loaded and saved like parameters).
        skipped_layers: layer indices a checkpoint may carry that the model does not build (their keys
            ``model.layers.{i}.*`` are skipped with one logged line), from the config.
        field: a structural field of a config in comparable form (default ``getattr``).
        layouts: other folders the model loads from (:class:`FolderLayout`, found by their ``model_type``); the
            writer writes the family's own layout.
        skipped: ``(stored prefix, what it is)`` of parts a checkpoint of the format's own layout may carry that
            the model does not build (``("mtp.", "multi-token prediction")``), each left out with one logged line.
        stored: parameters stored in another layout than the model's (:class:`StoredLayout`), None for none.
    """

    model_type: str
    architecture: str
    config_class: type[PretrainedConfig]
    check_config: Callable[[PretrainedConfig], None]
    structural_keys: tuple[str, ...]
    num_experts: Callable[[PretrainedConfig], int]
    buffers: tuple[str, ...] = ()
    skipped_layers: Callable[[PretrainedConfig], range] = _no_layers
    field: Callable[[PretrainedConfig, str], object] = _config_field
    layouts: tuple[FolderLayout, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    stored: StoredLayout | None = None

    def layout_of(self, model_type: object) -> FolderLayout | None:
        """The :class:`FolderLayout` of folders of ``model_type``, None for the format's own."""
        return next((lay for lay in self.layouts if lay.model_type == model_type), None)


def model_format(model: nn.Module | type[nn.Module]) -> HFFormat:
    """The :class:`HFFormat` of a model (or model class): its class's ``hf_format``.

    Raises:
        TypeError: the class names no ``hf_format`` (not a moeshard model family).
    """
    fmt = getattr(model if isinstance(model, type) else type(model), "hf_format", None)
    if not isinstance(fmt, HFFormat):
        name = (model if isinstance(model, type) else type(model)).__name__
        raise TypeError(f"{name} has no hf_format (an HFFormat): it is not a moeshard model family's model class")
    return fmt


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_hf_weights` did.

    Attributes:
        keys_read: checkpoint keys of which at least one element was read.
        bytes_read: bytes read from the files (in the stored dtype).
        casts: ``"bfloat16->float32"``-style dtype conversions → number of checkpoint tensors cast
            (``"float8_e4m3fn->bfloat16"`` for FP8 weights dequantised with their block scales).
        skipped: checkpoint keys left out on purpose (layers the model does not build, e.g. multi-token
            prediction).
    """

    keys_read: frozenset[str]
    bytes_read: int
    casts: dict[str, int]
    skipped: frozenset[str] = frozenset()


def _read_config_json(path: Path, fmt: HFFormat) -> dict:
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); restore the checkpoint's config.json") from None
    model_type = raw.get("model_type")
    layout = fmt.layout_of(model_type)
    if layout is not None:
        inner = raw.get(layout.config_key)
        if not isinstance(inner, dict):
            raise CheckpointError(
                f"{file} (model_type {model_type!r}) has no {layout.config_key!r} object: restore the checkpoint's "
                "config.json"
            )
        return {**inner, "model_type": fmt.model_type}
    if model_type != fmt.model_type:
        raise CheckpointError(
            f"{file} has model_type {model_type!r}, this model is {fmt.model_type!r}: point to a "
            f"{fmt.architecture} checkpoint, or use the model family of that architecture"
        )
    return raw


def _folder_layout(path: Path, fmt: HFFormat) -> FolderLayout | None:
    """The layout of the folder at ``path`` (by its config.json's ``model_type``), None for the format's own."""
    file = path / "config.json"
    if not fmt.layouts or not file.is_file():
        return None
    try:
        return fmt.layout_of(json.loads(file.read_text()).get("model_type"))
    except ValueError:
        return None  # reported by _read_config_json


def _apply_layout(ckpt: SafetensorsDir, fmt: HFFormat, layout: FolderLayout | None, path: Path) -> set[str]:
    """File ``ckpt``'s tensors under our keys and take out the parts the model does not build (one logged line
    each); returns the stored keys taken out."""
    ours, stored = layout.prefix if layout is not None else ("", "")
    parts = (layout.skipped if layout is not None else ()) + fmt.skipped
    skipped: list[list[str]] = [[] for _ in parts]
    tensors = {}
    for key, info in ckpt.tensors.items():
        part = next((i for i, (pre, _) in enumerate(parts) if key.startswith(pre)), None)
        if part is not None:
            skipped[part].append(key)
        else:
            tensors[ours + key[len(stored) :] if key.startswith(stored) else key] = info
    ckpt.tensors = tensors
    for (pre, what), keys in zip(parts, skipped):
        if keys:
            logger.warning(
                "load_hf_weights(%s): skipping %d tensors of %s (%s*), which this model does not build",
                path,
                len(keys),
                what,
                pre,
            )
    return {k for keys in skipped for k in keys}


def load_hf_config(path: str | os.PathLike, fmt: HFFormat) -> PretrainedConfig:
    """Read and check ``config.json`` of a local HF checkpoint directory of the family ``fmt``.

    Raises:
        FileNotFoundError: no such directory, or no config.json in it.
        CheckpointError: invalid JSON or another ``model_type``.
        ValueError: a config feature this model does not implement (see ``check_config``).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint directory {path} does not exist or is not a directory; pass the local folder holding "
            "config.json and *.safetensors (download it first: no network access is attempted)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; copy the checkpoint's config.json next to its weights")
    config = fmt.config_class.from_dict(_read_config_json(path, fmt))
    fmt.check_config(config)
    return config


def local_region(param: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
    """``(offset, local)``: where this rank's data sits in ``param``'s (DTensor-)global shape, and the tensor to
    write it to (a DTensor's local shard, shared with its storage; a plain tensor itself).

    Raises:
        ValueError: a DTensor placement other than Shard/Replicate (e.g. Partial or strided sharding).
    """
    if not isinstance(param, DTensor):
        return (0,) * param.dim(), param.detach()
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"cannot load into a DTensor placed {param.placements}: only Shard and Replicate are supported"
            )
    offset = shard_offset(param)
    local = param.to_local().detach()
    if local.numel() == 0:
        offset = (0,) * param.dim()
    return tuple(offset), local


def _clean_fqn(fqn: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        fqn = fqn.replace(seg, "")
    return fqn


@dataclass
class _Request:
    key: str
    slices: tuple[slice, ...]
    dst: torch.Tensor


@dataclass
class _Converted:
    """A parameter region filled from stored tensors in another layout: rows ``rows`` of dim 0 of each of ``keys``
    are read whole, converted (``StoredLayout.from_stored``), then cut to ``box`` (dims 1...)."""

    fqn: str
    keys: tuple[str, ...]
    rows: slice
    box: tuple[slice, ...]
    dst: torch.Tensor


def _expert_requests(
    fqn: str, global_shape: tuple[int, ...], offset: tuple[int, ...], local: torch.Tensor
) -> list[_Request]:
    """Reads that fill ``local`` (box ``offset`` + ``local.shape`` of a fused expert tensor) from per-expert keys."""
    prefix, _, name = fqn.rpartition(".")
    (e0, r0, c0), (ne, nr, nc) = offset, tuple(local.shape)
    cols = slice(c0, c0 + nc)
    reqs = []
    for e in range(e0, e0 + ne):
        dst = local[e - e0]
        if name == "down_proj":
            reqs.append(_Request(f"{prefix}.{e}.down_proj.weight", (slice(r0, r0 + nr), cols), dst))
            continue
        f = global_shape[1] // 2
        for proj, lo in (("gate_proj", 0), ("up_proj", f)):  # gate rows [0, F), up rows [F, 2F)
            a, b = max(r0, lo), min(r0 + nr, lo + f)
            if a < b:
                reqs.append(
                    _Request(f"{prefix}.{e}.{proj}.weight", (slice(a - lo, b - lo), cols), dst[a - r0 : b - r0])
                )
    return reqs


def _per_expert_keys(fqn: str, global_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Per-expert key → stored shape, for every expert of the fused parameter ``fqn`` of ``global_shape``."""
    prefix, _, name = fqn.rpartition(".")
    e, rows, cols = global_shape
    if name == "down_proj":  # [E, D, F] -> E x [D, F]
        return {f"{prefix}.{i}.down_proj.weight": (rows, cols) for i in range(e)}
    # [E, 2F, D] -> E x gate [F, D] + up [F, D]
    return {f"{prefix}.{i}.{p}.weight": (rows // 2, cols) for i in range(e) for p in ("gate_proj", "up_proj")}


def _check_structure(model: nn.Module, path: Path, fmt: HFFormat) -> None:
    config = getattr(model, "config", None)
    if config is None or not (path / "config.json").is_file():
        return
    ckpt_config = fmt.config_class.from_dict(_read_config_json(path, fmt))
    for name in fmt.structural_keys:
        ours, theirs = fmt.field(config, name), fmt.field(ckpt_config, name)
        if ours != theirs:
            raise CheckpointError(
                f"{path / 'config.json'} has {name}={theirs!r}, the model was built with {name}={ours!r}: build the "
                "model from this checkpoint's config (load_hf_config) or load a matching checkpoint"
            )


def _tensors(model: nn.Module, fmt: HFFormat):
    """``(fqn, tensor)`` of every parameter and of the persistent buffers the format stores."""
    yield from model.named_parameters()
    for fqn, buf in model.named_buffers():
        if fqn.endswith(fmt.buffers):
            yield fqn, buf


def _skipped_keys(found: set[str], layers: range) -> set[str]:
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    return {k for k in found if k.startswith(prefixes)} if prefixes else set()


def load_hf_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    ep_info: EPInfo | None = None,
    expert_range: tuple[int, int] | None = None,
    allow_dtype_cast: bool = True,
) -> LoadReport:
    """Fill every parameter of ``model`` in place from a local HF checkpoint, reading only this rank's slices.

    Works on plain models, after ``moeshard.ep.apply_ep`` (each expert parameter's global expert range comes
    from ``ep_info``, what ``apply_ep`` or ``parallelize`` returned) and after FSDP2 (DTensor parameters: only the local shard is read). Both expert
    layouts load (fused or per-expert keys, per layer). Float checkpoint tensors of another float dtype are cast to
    the parameter's dtype (reported in ``LoadReport.casts`` and logged); other dtype differences are errors. FP8
    weights with their block scales (``X.weight_scale_inv``, DeepSeek's Hub format) are dequantised to the
    parameter's dtype; an FP8 weight without scales is refused. The persistent buffers the model's format names
    (``HFFormat.buffers``) load like parameters; layers the format says the model does not build
    (``HFFormat.skipped_layers``) are skipped with one logged line. The format is the model class's ``hf_format``;
    a folder of one of its :class:`FolderLayout` s (a vision-language checkpoint) loads the model's part of it.
    LoRA adapters beside the base (``moeshard.lora``'s ``*lora_A`` / ``*lora_B``) are not read: they are not the
    base's (``moeshard.lora.reset_adapters`` or ``load_adapter`` give them their values).

    Args:
        model: a materialised model (no ``meta`` parameters) with our FQNs (wrappers' segments are ignored).
        path: the checkpoint directory.
        ep_info: the model's EP metadata (``apply_ep``'s result, ``Parallelized.ep_info``); needed when EP sliced
            the experts (EP size > 1), optional otherwise. An EP-sliced model without it is an error.
        expert_range: ``(start, end)`` when the model's expert parameters hold global experts ``[start, end)``
            without EP metadata (``from_pretrained(expert_range=...)``); ignored for parameters EP recorded.
        allow_dtype_cast: False makes a float dtype difference an error too.

    Returns:
        A :class:`LoadReport`.

    Raises:
        FileNotFoundError: no such directory / shard.
        CheckpointError: other architecture, config mismatch, missing or unexpected keys, shape or dtype
            mismatch, truncated or corrupt files; nothing is written to the model in these cases.
    """
    path = Path(path)
    fmt = model_format(model)
    ckpt = SafetensorsDir(path)
    _check_structure(model, path, fmt)
    layout = _folder_layout(path, fmt)
    left_out = _apply_layout(ckpt, fmt, layout, path) if layout is not None or fmt.skipped else set()
    config = getattr(model, "config", None)
    num_experts = fmt.num_experts(config) if config is not None else None

    requests, converted, wanted_shape = _plan(model, ckpt, fmt, ep_info, expert_range, num_experts)
    found = ckpt.keys()
    skipped = _skipped_keys(found, fmt.skipped_layers(config)) if config is not None else set()
    if skipped:
        layers = sorted({int(k.split(".")[2]) for k in skipped})
        logger.warning(
            "load_hf_weights(%s): skipping %d tensors of model.layers.%s (multi-token prediction), which this model "
            "does not build",
            path,
            len(skipped),
            layers[0] if len(layers) == 1 else layers,
        )
    scales = {k for k in found if k.endswith(SCALE_SUFFIX) and k.removesuffix(SCALE_SUFFIX) in wanted_shape}
    check_keys(path, set(wanted_shape), found - skipped - scales)
    for key, shape in wanted_shape.items():
        info = ckpt.info(key)
        if info.shape != shape:
            raise CheckpointError(
                f"{key} in {info.file.name} has shape {list(info.shape)}, the model needs {list(shape)}: "
                "the checkpoint and the model's config disagree (build the model from this checkpoint's config)"
            )
    block = fp8_block(config)
    fp8 = sorted({r.key for r in requests if ckpt.info(r.key).dtype in FP8})
    check_fp8(ckpt, fp8, block)
    casts = check_dtypes(ckpt, requests, set(fp8), allow_dtype_cast)
    for label, n in _converted_casts(ckpt, converted, allow_dtype_cast).items():
        casts[label] = casts.get(label, 0) + n
    if casts:
        logger.info("load_hf_weights(%s): cast checkpoint tensors to the parameters' dtypes: %s", path, casts)

    bytes_read = 0
    scale_of = read_scales(ckpt, fp8)
    with torch.no_grad():
        for i, _key, tensor in ckpt.read((r.key, r.slices) for r in requests):
            req = requests[i]
            assert tuple(tensor.shape) == tuple(req.dst.shape), (req.key, tensor.shape, req.dst.shape)
            bytes_read += tensor.numel() * tensor.element_size()
            if req.key in scale_of:
                tensor = dequantize(tensor, scale_of[req.key], req.slices, block, req.dst.dtype)
            req.dst.copy_(tensor)
        for conv in converted:  # one parameter's rows at a time: host memory holds one rank's experts of one tensor
            reads = [(key, (conv.rows,) + (slice(None),) * (len(ckpt.info(key).shape) - 1)) for key in conv.keys]
            stored = {key: tensor for _, key, tensor in ckpt.read(reads)}
            bytes_read += sum(t.numel() * t.element_size() for t in stored.values())
            value = fmt.stored.from_stored(conv.fqn, stored, conv.dst.dtype)
            conv.dst.copy_(value[(slice(None), *conv.box)])
    return LoadReport(
        keys_read=frozenset([r.key for r in requests] + [k for c in converted for k in c.keys]),
        bytes_read=bytes_read,
        casts=casts,
        skipped=frozenset(skipped | left_out),
    )


def _converted_casts(ckpt: SafetensorsDir, converted: list[_Converted], allow_dtype_cast: bool) -> dict[str, int]:
    """``"src->dst"`` -> parameters converted from stored tensors of other dtypes (``"uint8->float32"`` for a
    quantised format); a float-to-float cast with ``allow_dtype_cast=False`` is refused."""
    counts: Counter[str] = Counter()
    for conv in converted:
        dtypes = {ckpt.info(key).dtype for key in conv.keys}
        if dtypes == {conv.dst.dtype}:
            continue
        if not allow_dtype_cast and all(d.is_floating_point for d in dtypes):
            raise CheckpointError(
                f"{conv.keys[0]} is stored as {sorted(map(str, dtypes))}, the parameter {conv.fqn} is "
                f"{conv.dst.dtype}: pass allow_dtype_cast=True (or convert the checkpoint or the model's dtype)"
            )
        names = ",".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        counts[f"{names}->{str(conv.dst.dtype).removeprefix('torch.')}"] += 1
    return dict(counts)


_ADAPTER_SUFFIXES = (".lora_A", ".lora_B", "_lora_A", "_lora_B")


def _plan(
    model: nn.Module,
    ckpt: SafetensorsDir,
    fmt: HFFormat,
    ep_info: EPInfo | None,
    expert_range: tuple[int, int] | None,
    num_experts: int | None,
) -> tuple[list[_Request], list[_Converted], dict[str, tuple[int, ...]]]:
    """``(reads that fill this rank's boxes, regions filled from another stored layout, every checkpoint key the
    model needs -> its stored shape)``; expert tensors read from fused keys where the checkpoint has them, else from
    per-expert keys."""
    requests: list[_Request] = []
    converted: list[_Converted] = []
    wanted_shape: dict[str, tuple[int, ...]] = {}
    found = ckpt.keys()
    for raw_fqn, param in _tensors(model, fmt):
        fqn = _clean_fqn(raw_fqn)
        if fqn.endswith(_ADAPTER_SUFFIXES):
            continue  # LoRA's adapters (moeshard.lora) beside a frozen base: not in the base's checkpoint
        if param.device.type == "meta":
            raise ValueError(f"parameter {fqn} is on the meta device: materialise the model (to_empty) before loading")
        offset, local = local_region(param)
        global_shape = tuple(param.shape)
        meta = ep_info.params.get(fqn) if ep_info is not None else None
        is_expert = fqn.endswith(_EXPERT_SUFFIXES)
        # any tensor of the routed experts (a family's expert biases too) holds one row per expert on dim 0
        per_expert_rows = ".mlp.experts." in fqn
        if meta is not None:
            global_shape, start = tuple(meta.global_shape), meta.expert_start
            offset = (offset[0] + start, *offset[1:])
        elif per_expert_rows and expert_range is not None:
            start, end = expert_range
            if global_shape[0] != end - start or num_experts is None:
                raise ValueError(
                    f"{fqn} holds {global_shape[0]} experts but expert_range={expert_range} spans {end - start}"
                )
            global_shape = (num_experts, *global_shape[1:])
            offset = (offset[0] + start, *offset[1:])
        elif per_expert_rows and num_experts is not None and global_shape[0] != num_experts:
            raise ValueError(
                f"{fqn} holds {global_shape[0]} of the model's {num_experts} experts (EP applied) but no ep_info was "
                "given: pass load_hf_weights(..., ep_info=...) with what apply_ep / parallelize returned"
            )

        stored = fmt.stored.stored_keys(fqn, global_shape, found) if fmt.stored is not None else None
        if stored is not None:
            wanted_shape.update(stored)
            if local.numel():
                rows = slice(offset[0], offset[0] + local.shape[0])
                box = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
                converted.append(_Converted(fqn, tuple(stored), rows, box, local))
            continue
        if not is_expert or fqn in ckpt:
            wanted_shape[fqn] = global_shape
            if fqn in ckpt and local.numel():
                requests.append(_Request(fqn, tuple(slice(o, o + n) for o, n in zip(offset, local.shape)), local))
            continue
        # Per-expert layout: the fused tensor's shape fixes each expert tensor's shape.
        keys = _per_expert_keys(fqn, global_shape)
        wanted_shape.update(keys)
        if local.numel():
            requests.extend(_expert_requests(fqn, global_shape, offset, local))

    return requests, converted, wanted_shape
