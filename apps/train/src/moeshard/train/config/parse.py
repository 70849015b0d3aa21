"""Reading the job's configuration: YAML files, ``--section.key=value`` values and their types, one-line errors.

The sections themselves (one frozen dataclass each) and the checks across keys are in :mod:`moeshard.train.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line (``async`` for ``CheckpointConfig.async_``)."""
    return f.metadata.get("key", f.name)


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def coerce(key: str, value: Any, tp: Any, known: Sequence[str] | None = None) -> Any:
    """``value`` as type ``tp`` (YAML's types to the dataclass field's), or ConfigError naming ``key`` (``known``:
    the keys an unknown one in a group may be suggested from, :func:`section_from_dict`)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if value is False and type(None) in args and any(dataclasses.is_dataclass(a) for a in args):
            return None  # logging.wandb: false, as null: off
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(key, value, a, known)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if tp is Any:
        return value
    if origin is typing.Literal:  # the packages' choices (ParallelOptions, EPOptions)
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ConfigError(f"{key} must be one of {', '.join(map(str, args))}, got {value!r}")
    if dataclasses.is_dataclass(tp):  # a group of keys inside a section (logging.wandb)
        if isinstance(value, tp):
            return value
        return section_from_dict(tp, key, {} if value is True else value, known)  # true: its defaults
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[str, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(coerce(key, v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(coerce(key, v, a) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def section_from_dict(cls: type, name: str, raw: dict[str, Any], known: Sequence[str] | None = None) -> Any:
    """The dataclass ``cls`` of section ``name`` from its mapping; unknown keys are errors with a suggestion (from
    ``known``, the dotted keys to suggest; default: those of ``cls``).

    The ``ValueError`` of a class's own checks, which names a field as ``<class>.<field>`` (``EPOptions.sm_carveout``,
    ``ParallelOptions.prefetch_depth``), is reported in the job's key names (``parallel.ep.sm_carveout``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            near = did_you_mean(f"{name}.{key}", keys_of(cls, name) if known is None else known)
            hint = f"; did you mean {near}?" if near else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"unknown config key {name}.{key}{hint}")
    values = {fields[k]: coerce(f"{name}.{k}", v, hints[fields[k]], known) for k, v in raw.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as e:
        classes = [c.__name__ for c in cls.__mro__ if dataclasses.is_dataclass(c)]
        raise ConfigError(re.sub(rf"(?<![\w.])({'|'.join(classes)})\.", f"{name}.", str(e))) from None


def group_type(tp: Any) -> type | None:
    """The dataclass of a field that is a group of keys (``train.aux_loss``; ``logging.wandb``, optional), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = typing.get_args(tp)
    groups = [a for a in args if dataclasses.is_dataclass(a)] if type(None) in args else []
    return groups[0] if groups else None


def keys_of(cls: type, prefix: str) -> list[str]:
    """Every dotted key of the dataclass ``cls`` under ``prefix``, with its groups' (``parallel.ep.dispatch``)."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{yaml_key(f)}"
        keys.append(key)
        group = group_type(hints[f.name])
        if group is not None:
            keys += keys_of(group, key)
    return keys


def did_you_mean(key: str, known: Sequence[str]) -> str | None:
    """The key of ``known`` that an unknown dotted ``key`` most likely meant, else None: its name in a group of its
    section (``parallel.dispatch``: ``parallel.ep.dispatch``), a close spelling beside it (``train.lrr``:
    ``train.lr``), its name in another section (``train.compile``: ``parallel.compile``), a close spelling in a group
    below it (``parallel.expert_kernels``: ``parallel.ep.kernels``)."""
    parent, leaf = key.rsplit(".", 1)
    section = key.split(".", 1)[0]
    same_name = [k for k in known if k.rsplit(".", 1)[1] == leaf and k != key]
    below = [k for k in known if k.startswith(f"{parent}.") and k.count(".") > key.count(".")]

    def closest(candidates: list[str]) -> str | None:
        by_name = {k.rsplit(".", 1)[1]: k for k in reversed(candidates)}  # the first key of each name wins
        near = difflib.get_close_matches(leaf, list(by_name), n=1)
        return by_name[near[0]] if near else None

    return (
        next((k for k in same_name if k.startswith(f"{section}.")), None)
        or closest([k for k in known if k.rsplit(".", 1)[0] == parent])
        or next(iter(same_name), None)
        or closest(below)
    )


def parse_value(text: str) -> Any:
    """A command-line override's value, read as YAML (``--train.lr=1e-4``, ``--data.sources=[...]``)."""
    return yaml.safe_load(text) if text != "" else ""


def read_config_file(p: Path) -> dict[str, Any]:
    """The file's mapping of sections. Raises ConfigError (one line: ``file:line:column`` for a YAML error) for a
    missing, unreadable or empty file and for anything but a mapping of section names."""
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem, context = getattr(e, "problem", None), getattr(e, "context", None)
        what = f"{problem}{f' ({context})' if context else ''}" if problem else str(e).replace("\n", " ")
        raise ConfigError(f"config file {where}: YAML syntax error: {what}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} cannot be read: {e}") from None
    if loaded is None:
        raise ConfigError(
            f"config file {p} is empty; give it sections (model:, train:, ...), or leave out --config for the "
            "embedded default job"
        )
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config file {p} must hold a mapping of sections (model:, train:, ...), got a {type(loaded).__name__}"
        )
    for key in loaded:
        if not isinstance(key, str):
            raise ConfigError(f"config file {p}: section names are words (model, train, ...), got {key!r}")
    return loaded
