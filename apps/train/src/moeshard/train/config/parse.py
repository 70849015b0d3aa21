"""Reading the job's configuration: YAML files, ``--section.key=value`` values and their types, one-line errors.

The sections themselves (one frozen dataclass each) and the checks across keys are in :mod:`moeshard.train.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml


def yaml_key(f: dataclasses.Field) -> str:
    """A field's key in YAML and on the command line (``async`` for ``CheckpointConfig.async_``)."""
    return f.metadata.get("key", f.name)


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message names the key."""


def coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (YAML's types to the dataclass field's), or ConfigError naming ``key``."""
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
                return coerce(key, value, a)
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
        return section_from_dict(tp, key, {} if value is True else value)  # true: its defaults
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


def section_from_dict(cls: type, name: str, raw: dict[str, Any]) -> Any:
    """The dataclass ``cls`` of section ``name`` from its mapping; unknown keys are errors with a suggestion."""
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {yaml_key(f): f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {name}.{near[0]}?" if near else f"; known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"unknown config key {name}.{key}{hint}")
    return cls(**{known[k]: coerce(f"{name}.{k}", v, hints[known[k]]) for k, v in raw.items()})


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
