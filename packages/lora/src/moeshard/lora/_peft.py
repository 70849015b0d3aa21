"""PEFT's adapter folder, in and out: ``adapter_config.json`` and ``adapter_model.safetensors``.

What ``peft.PeftModel.from_pretrained(transformers_model, folder)`` loads and ``PeftModel.save_pretrained`` writes
(PEFT 0.17 and later). Names, for a model whose module names are the transformers model's:

- linear module ``m``: ``base_model.model.m.lora_A.weight [r, in]``, ``...m.lora_B.weight [out, r]``;
- fused expert tensor ``m.p [E, out, in]`` (``LoraConfig.target_parameters``): PEFT wraps each targeted tensor of
  ``m`` in a ``ParamWrapper``, one inside the other in the order ``m`` registers them, so the k-th from the outside
  is named ``m`` + ``.base_layer`` k times; its ``lora_A.weight`` is ``[E·r, in]`` with rows expert-major (row
  ``e·r + j`` is expert e's row j) and its ``lora_B.weight`` is ``[out, r·E]`` with columns rank-major (column
  ``j·E + e``), as ``ParamWrapper.get_delta_weight`` reads them.

PEFT 0.21 on transformers 5 rewrites, for MoE model types it maps to ``qwen2_moe`` or ``mixtral`` (Qwen3-MoE and
DeepSeek-V3 among them), every ``target_modules`` entry named or ending in ``.gate_proj``, ``.up_proj``,
``.down_proj``, ``.gate``, ``.w1``, ``.w2`` or ``.w3`` as a per-expert linear of transformers 4 and retargets it onto
the fused experts; a regular expression is first resolved to the leaf names it matches, so it is rewritten alike
(``_convert_peft_config_moe`` in ``peft/utils/transformers_weight_conversion.py``). ``target_parameters`` are left
as written, and an entry there naming a linear module's ``weight`` gets a ``ParamWrapper`` with the names and delta
of a linear LoRA layer. So the folder names such linear targets in ``target_parameters`` (``m.weight``), and a
regular expression is written as the module names it matched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeshard.lora._apply import EXPERTS, LoraAdapters, LoraTarget, _module_matches, _remapped
from moeshard.lora._options import LoraOptions

__all__ = ["load_adapter", "read_adapter_options", "save_adapter"]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _peft_names(t: LoraTarget) -> tuple[str, str]:
    module = t.module + ".base_layer" * t.nesting
    return f"{PREFIX}{module}.lora_A.weight", f"{PREFIX}{module}.lora_B.weight"


def _to_peft(t: LoraTarget, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if t.kind != EXPERTS:
        return A, B
    E, r, in_f = A.shape
    return A.reshape(E * r, in_f), B.permute(1, 2, 0).reshape(B.shape[1], r * E)


def _from_peft(t: LoraTarget, A: torch.Tensor, B: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    if t.kind != EXPERTS:
        return A, B
    r = A.shape[0] // experts
    return A.reshape(experts, r, A.shape[1]), B.reshape(B.shape[0], r, experts).permute(2, 0, 1)


def _peft_targets(adapters: LoraAdapters) -> tuple[list[str], list[str]]:
    """``(target_modules, target_parameters)`` as the folder writes them: what PEFT loads as the job targeted it."""
    options = adapters.options
    if isinstance(options.target_modules, str):
        modules = sorted(t.module for t in adapters.targets if t.kind != EXPERTS)
    else:
        modules = sorted(set(options.target_modules))
    params = set(options.target_parameters) | {f"{m}.weight" for m in modules if _remapped(m)}
    return [m for m in modules if not _remapped(m)], sorted(params)


def _config(adapters: LoraAdapters, base_model: str | None, model_class: str | None) -> dict:
    options = adapters.options
    modules, params = _peft_targets(adapters)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": options.rank,
        "lora_alpha": options.alpha,
        "use_rslora": options.use_rslora,
        "target_modules": modules or None,
        "target_parameters": params or None,
        "lora_dropout": options.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "lora_bias": False,
    }
    if model_class:
        config["auto_mapping"] = {"base_model_class": model_class, "parent_library": "transformers"}
    return config


def save_adapter(
    path: str | os.PathLike,
    adapters: LoraAdapters,
    tensors: Mapping[str, torch.Tensor],
    *,
    base_model: str | None = None,
    model_class: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a PEFT adapter folder (created if needed; only its two files are written, atomically each).

    Args:
        path: the folder.
        adapters: what :func:`~moeshard.lora.apply_lora` returned (the options and targets).
        tensors: the full adapter tensors by their names in the model (:meth:`LoraAdapters.state_dict`; gathered
            first where sharded).
        base_model: the base model's Hub id or path (``base_model_name_or_path``, checked by :func:`load_adapter`).
        model_class: the transformers class (``Qwen3MoeForCausalLM``), recorded like PEFT does.
        dtype: the stored dtype; None keeps the tensors' own (float32 masters).

    Returns:
        The folder's path.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for t in adapters.targets:
        A, B = _to_peft(t, tensors[t.a_name].detach(), tensors[t.b_name].detach())
        a_name, b_name = _peft_names(t)
        for name, x in ((a_name, A), (b_name, B)):
            out[name] = (x if dtype is None else x.to(dtype)).to("cpu").contiguous()
    tmp = folder / f".{WEIGHTS}.tmp"
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / WEIGHTS)
    tmp = folder / f".{CONFIG}.tmp"
    tmp.write_text(json.dumps(_config(adapters, base_model, model_class), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / CONFIG)
    return folder


def _read_config(folder: Path) -> dict:
    if not (folder / CONFIG).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(
            f"lora.init_from: {folder} is not a PEFT adapter folder (it needs {CONFIG} and {WEIGHTS}, as "
            "PeftModel.save_pretrained writes them)"
        )
    try:
        return json.loads((folder / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"lora.init_from: {folder / CONFIG} is not valid JSON ({e})") from None


def read_adapter_options(path: str | os.PathLike) -> LoraOptions:
    """The :class:`LoraOptions` a PEFT adapter folder was trained with (``init_from`` set to the folder)."""
    folder = Path(path)
    config = _read_config(folder)
    _check_supported(folder, config)
    tm = config.get("target_modules") or ()
    return LoraOptions(
        rank=int(config["r"]),
        alpha=config.get("lora_alpha", 8),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=tm if isinstance(tm, str) else tuple(sorted(tm)),
        target_parameters=tuple(sorted(config.get("target_parameters") or ())),
        init_from=str(folder),
        dropout=float(config.get("lora_dropout") or 0.0),
    )


def _check_supported(folder: Path, config: dict) -> None:
    if config.get("peft_type") != "LORA":
        raise ValueError(f"lora.init_from: {folder} holds a {config.get('peft_type')} adapter, not LoRA")
    unsupported = [
        ("use_dora", bool(config.get("use_dora"))),
        ("lora_bias", bool(config.get("lora_bias"))),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ("rank_pattern", bool(config.get("rank_pattern"))),
        ("alpha_pattern", bool(config.get("alpha_pattern"))),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("layers_to_transform", config.get("layers_to_transform") is not None),
        ("bias", config.get("bias", "none") != "none"),
    ]
    for name, used in unsupported:
        if used:
            raise ValueError(
                f"lora.init_from: {folder} uses PEFT's {name}={config.get(name)!r}, which is not supported"
            )


def _same_base(a: str, b: str) -> bool:
    """A Hub id and a local copy of it name the same model (``Qwen/Qwen3-30B-A3B`` and ``/models/Qwen3-30B-A3B``)."""
    return Path(a.rstrip("/")).name == Path(b.rstrip("/")).name


def load_adapter(
    path: str | os.PathLike, adapters: LoraAdapters, *, base_model: str | None = None
) -> dict[str, torch.Tensor]:
    """Read a PEFT adapter folder into tensors named as in the model (for :meth:`LoraAdapters.load_state_dict`).

    Args:
        path: the folder (``adapter_config.json``, ``adapter_model.safetensors``).
        adapters: the model's adapters; the folder must have their rank, alpha, rslora and targets.
        base_model: the job's base model (Hub id or path); when the folder names one too, their last path
            components must agree.

    Returns:
        ``{name in the model: tensor}`` in the stored dtype. Every difference (options, targets, base model, a
        missing, extra or misshapen tensor) raises ``ValueError`` with one line.
    """
    folder = Path(path)
    config = _read_config(folder)
    _check_supported(folder, config)
    theirs = read_adapter_options(folder)
    ours = adapters.options
    for name, a, b in (
        ("rank", theirs.rank, ours.rank),
        ("alpha", float(theirs.alpha), float(ours.alpha)),
        ("use_rslora", theirs.use_rslora, ours.use_rslora),
    ):
        if a != b:
            raise ValueError(f"lora.init_from: {folder} has {name}={a}, this job {name}={b}; set lora.{name}: {a}")
    difference = _target_difference(theirs, adapters)
    if difference:
        raise ValueError(
            f"lora.init_from: {folder} targets modules {theirs.target_modules} and parameters "
            f"{list(theirs.target_parameters)}, this job {ours.target_modules} and {list(ours.target_parameters)} "
            f"({difference}); use the adapter's targets"
        )
    theirs_base = config.get("base_model_name_or_path")
    if base_model and theirs_base and not _same_base(theirs_base, base_model):
        raise ValueError(
            f"lora.init_from: {folder} was trained on {theirs_base}, this job's base model is {base_model}"
        )
    stored = load_file(str(folder / WEIGHTS))
    stored = {k.replace(".default.", "."): v for k, v in stored.items()}  # PEFT strips the adapter name; some don't
    out, used = {}, set()
    for t in adapters.targets:
        a_name, b_name = _peft_names(t)
        for name in (a_name, b_name):
            if name not in stored:
                raise ValueError(
                    f"lora.init_from: {folder / WEIGHTS} has no {name}: the adapter was made for another model"
                )
        A, B = stored[a_name], stored[b_name]
        experts = 0
        if t.kind == EXPERTS:
            experts = _expected(adapters, t)[0][0]
            if A.dim() != 2 or A.shape[0] % experts:
                raise ValueError(f"lora.init_from: {a_name} has shape {tuple(A.shape)}, not [{experts}·r, in]")
        A, B = _from_peft(t, A, B, experts)
        for name, got, want in ((a_name, A, _expected(adapters, t)[0]), (b_name, B, _expected(adapters, t)[1])):
            if tuple(got.shape) != want:
                raise ValueError(
                    f"lora.init_from: {name} holds shape {tuple(got.shape)} where this model needs {want} (a "
                    "different base model)"
                )
        out[t.a_name], out[t.b_name] = A.contiguous(), B.contiguous()
        used.update((a_name, b_name))
    extra = sorted(set(stored) - used)
    if extra:
        raise ValueError(
            f"lora.init_from: {folder / WEIGHTS} holds {extra[0]} ({len(extra)} tensors) that this model's targets "
            "do not name"
        )
    return out


def _target_difference(folder: LoraOptions, adapters: LoraAdapters) -> str | None:
    """Where the folder's targets and the job's differ, or None: compared by what they target in the model, so a
    folder written by :func:`save_adapter` (linear weights in ``target_parameters``, a regular expression written
    as module names) and one naming the same tensors as the job's options do agree."""

    def hits(key: str, entry: str) -> bool:
        return key == entry or key.endswith(f".{entry}")

    def covered(t: LoraTarget) -> bool:
        if any(hits(t.base_name, e) for e in folder.target_parameters):
            return True
        return t.kind != EXPERTS and bool(folder.target_modules) and _module_matches(t.module, folder.target_modules)

    for t in adapters.targets:
        if not covered(t):
            return f"the folder does not target {t.base_name}"
    linear = [t.module for t in adapters.targets if t.kind != EXPERTS]
    tm = folder.target_modules
    entries = [tm] if isinstance(tm, str) else list(tm)
    for e in entries:
        if not any(_module_matches(m, e if isinstance(tm, str) else (e,)) for m in linear):
            return f"the job targets no module that its target_modules entry {e!r} names"
    for e in folder.target_parameters:
        if not any(hits(t.base_name, e) for t in adapters.targets):
            return f"the job targets no tensor that its target_parameters entry {e!r} names"
    return None


def _expected(adapters: LoraAdapters, t: LoraTarget) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of A and B of ``t``, as :func:`~moeshard.lora.apply_lora` made them."""
    return adapters.shapes[t.a_name], adapters.shapes[t.b_name]
