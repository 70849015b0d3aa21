"""Named configurations of a family: a preset's fields, overridden by keyword, as a checked config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from transformers import PretrainedConfig

__all__ = ["check_common_config", "config_keys", "preset_config"]


def config_keys(config_class: type[PretrainedConfig], *extra: str) -> frozenset[str]:
    """The fields a ``config_class`` understands: its dataclass fields plus ``extra`` (read through kwargs)."""
    return frozenset(f.name for f in dataclasses.fields(config_class)) | set(extra)


def preset_config(
    family: str,
    presets: Mapping[str, Mapping[str, Any]],
    config_class: type[PretrainedConfig],
    check: Callable[[PretrainedConfig], None],
    keys: frozenset[str],
    name: str,
    overrides: Mapping[str, Any],
) -> PretrainedConfig:
    """``config_class(**presets[name], **overrides)``, checked by ``check``. ``rope_theta`` sets that entry of the
    preset's ``rope_parameters``. ``family`` names the family in errors (``"Qwen3-MoE"``).

    Raises:
        ValueError: unknown preset name or an override key not in ``keys``.
    """
    if name not in presets:
        raise ValueError(f"unknown {family} preset {name!r}; choose one of {sorted(presets)}")
    unknown = sorted(set(overrides) - keys)
    if unknown:
        raise ValueError(
            f"unknown {config_class.__name__} field(s) {unknown} in the overrides of preset {name!r}; "
            f"valid fields: {sorted(keys)}"
        )
    values, overrides = dict(presets[name]), dict(overrides)
    if "rope_theta" in overrides:
        values["rope_parameters"] = {**values["rope_parameters"], "rope_theta": float(overrides.pop("rope_theta"))}
    values.update(overrides)
    config = config_class(**values)
    check(config)
    return config


def check_common_config(config: PretrainedConfig, model_type: str, family: str) -> None:
    """The checks every family makes: its ``model_type``, SwiGLU (``silu``) MLPs, untied embeddings.

    Raises:
        ValueError: naming the field and the fix.
    """
    found = getattr(config, "model_type", None)
    if found != model_type:
        raise ValueError(
            f"config has model_type {found!r}, this model is {model_type!r}; load a {family} checkpoint or config"
        )
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r} is not supported: the experts are SwiGLU; use 'silu'")
    if config.tie_word_embeddings:
        raise ValueError(f"tie_word_embeddings=True is not supported ({family} is untied); set it to False")
