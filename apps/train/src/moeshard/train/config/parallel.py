"""The ``parallel:`` section of the job: ``moeshard.models.common.ParallelOptions``, with ``EPOptions`` nested as
``parallel.ep``, plus the mesh keys (``ep_size``, ``allow_cross_node_ep``).

Generated from the packages' dataclasses, so nothing is written twice: key names are the fields' names, defaults
the fields' defaults, allowed values their ``Literal`` types and each key's meaning the ``Attributes:`` entry of
the class docstring; the checks are the dataclasses' own (their ``ValueError`` is reported in the job's key
names). ``config --show``, ``--help`` and the README's table are generated from the same fields.

Keys of 0.3 that moved here (``train.compile``, ``train.activation_checkpointing``, ``train.selective_recompute``,
``model.dtype``, ``parallel.dispatch``, ``parallel.expert_kernels``, ``parallel.sm_carveout``,
``train.fused_expert_update``) still work for this release: :func:`migrate` moves them and prints one line each.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import field
from typing import Any

from moeshard.ep import EPOptions
from moeshard.models.common import ParallelOptions
from moeshard.train.config.parse import ConfigError

__all__ = ["DEPRECATED", "EPConfig", "ParallelConfig", "attribute_docs", "migrate", "parallel_options"]

EP_EXCLUDED = ("recompute",)
"""``EPOptions`` fields the job does not expose: the experts' recompute is ``parallel.activation_checkpointing:
selective`` with ``parallel.selective_recompute`` (``ParallelOptions`` chooses the checkpointing policy in one
place)."""


def attribute_docs(cls: type) -> dict[str, str]:
    """Each attribute's meaning from the ``Attributes:`` section of ``cls``'s (Google-style) docstring, as one line
    (an entry naming several attributes, ``a, b: ...``, gives each the same text)."""
    lines = (inspect.getdoc(cls) or "").splitlines()
    if "Attributes:" not in (line.strip() for line in lines):
        return {}
    start = [line.strip() for line in lines].index("Attributes:") + 1
    docs: dict[str, list[str]] = {}
    names: list[str] = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^ {4}(\w+(?:, \w+)*): (.*)$", line)
        if entry:
            names = entry.group(1).split(", ")
            for name in names:
                docs[name] = [entry.group(2)]
        elif line.strip():
            for name in names:
                docs[name].append(line.strip())
    return {name: re.sub(r"``([^`]*)``", r"`\1`", " ".join(text)) for name, text in docs.items()}


def _section(
    name: str, options_cls: type, first: list[tuple[str, Any, Any]], skip: tuple[str, ...], nested: dict[str, type]
) -> type:
    """A frozen dataclass of the keys of ``options_cls`` (after ``first``, the job's own), each field carrying its
    help; ``nested`` fields become groups of their own."""
    hints, docs, defaults = typing.get_type_hints(options_cls), attribute_docs(options_cls), options_cls()
    fields: list[tuple[str, Any, Any]] = list(first)
    for f in dataclasses.fields(options_cls):
        if f.name in skip:
            continue
        meta = {"help": docs.get(f.name, "")}
        if f.name in nested:
            fields.append((f.name, nested[f.name], field(default_factory=nested[f.name], metadata=meta)))
        else:
            fields.append((f.name, hints[f.name], field(default=getattr(defaults, f.name), metadata=meta)))
    doc = f"The job's keys of ``{options_cls.__module__.rsplit('._', 1)[0]}.{options_cls.__name__}`` (generated)."
    return dataclasses.make_dataclass(name, fields, frozen=True, namespace={"__doc__": doc})


EPConfig = _section("EPConfig", EPOptions, [], EP_EXCLUDED, {})
"""``parallel.ep``: the fields of ``moeshard.ep.EPOptions`` (but ``recompute``, see :data:`EP_EXCLUDED`)."""

_MESH_KEYS = [
    (
        "ep_size",
        int,
        field(default=2, metadata={"help": "expert-parallel ranks (divides the ranks per node and the experts)"}),
    ),
    (
        "allow_cross_node_ep",
        bool,
        field(
            default=False,
            metadata={"help": "let an EP group span nodes (its all-to-all then crosses the slow links)"},
        ),
    ),
]

ParallelConfig = _section("ParallelConfig", ParallelOptions, _MESH_KEYS, (), {"ep": EPConfig})
"""``parallel``: ``ep_size`` and ``allow_cross_node_ep`` (``moeshard.meshes.build_meshes``), then every field of
``moeshard.models.common.ParallelOptions`` with ``ep`` (:data:`EPConfig`)."""


def parallel_options(cfg: Any) -> ParallelOptions:
    """The job's ``parallel`` section as ``ParallelOptions`` (training, ``plan`` and ``bench`` all build through it).

    Raises:
        ConfigError: the packages refuse a value (their message, in the job's key names).
    """
    p = cfg.parallel
    own = {f.name for f in dataclasses.fields(ParallelOptions)} - {"ep"}
    try:
        ep = EPOptions(**{f.name: getattr(p.ep, f.name) for f in dataclasses.fields(EPConfig)})
        return ParallelOptions(ep=ep, **{name: getattr(p, name) for name in own})
    except ValueError as e:
        text = str(e).replace("ParallelOptions.ep has ", "parallel.ep has ")
        text = text.replace("ParallelOptions.", "parallel.").replace("EPOptions.", "parallel.ep.")
        raise ConfigError(text) from None


def _kernels(value: Any, raw: dict[str, Any]) -> Any:
    # 0.3's auto: triton with train.compile, else eager.
    if value != "auto":
        return value
    compiled = raw.get("parallel", {}).get("compile", raw.get("train", {}).get("compile", False))
    return "triton" if compiled is True else "eager"


DEPRECATED: dict[str, tuple[str, Callable[[Any, dict[str, Any]], Any] | None]] = {
    "train.compile": ("parallel.compile", None),
    "train.activation_checkpointing": ("parallel.activation_checkpointing", None),
    "train.selective_recompute": ("parallel.selective_recompute", None),
    "model.dtype": ("parallel.param_dtype", None),
    "parallel.dispatch": ("parallel.ep.dispatch", None),
    "parallel.expert_kernels": ("parallel.ep.kernels", _kernels),
    "parallel.sm_carveout": ("parallel.ep.sm_carveout", None),
    "train.fused_expert_update": ("train.fuse_local_experts", None),
}
"""Keys of 0.3 → their key now (and how a value changes, where it does); they work for one release."""


def migrate(raw: dict[str, Any], *, warn: bool = True) -> None:
    """Move the :data:`DEPRECATED` keys of a mapping of sections to their new place, in place; one line on stderr
    per old key found (rank 0 only; none with ``warn=False``, e.g. a checkpoint's saved config).

    Raises:
        ConfigError: an old key and its new key are both given.
    """
    old_compile = isinstance(raw.get("train"), dict) and raw["train"].get("compile") is True
    kernels_given = "expert_kernels" in raw.get("parallel", {}) or "kernels" in raw.get("parallel", {}).get("ep", {})
    for old, (new, convert) in DEPRECATED.items():
        section, key = old.split(".")
        group = raw.get(section)
        if not isinstance(group, dict) or key not in group:
            continue
        value = group.pop(key)
        *path, last = new.split(".")
        target = raw
        for part in path:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        if last in target:
            raise ConfigError(f"{old} and {new} are both set; {old} is the old name of {new}: keep {new} only")
        target[last] = convert(value, raw) if convert is not None else value
        if warn and os.environ.get("RANK", "0") == "0":
            print(f"moeshard-train: {old} is deprecated, use {new} (the old key goes in 0.5)", file=sys.stderr)
    if old_compile and not kernels_given:  # 0.3's parallel.expert_kernels default, auto: triton with train.compile
        raw["parallel"]["ep"] = {**raw["parallel"].get("ep", {}), "kernels": "triton"}
