"""The model families the job trains: ``model.family`` (or a Hub folder's ``model_type``) picks one.

Each family package exports its ``FAMILY`` (a ``moeshard.models.common.ModelFamily``: model class, presets, config
loading, parameter and FLOP counts); the job knows families only through it, so everything after the model's
construction (``parallelize``, checkpoints, balancing, the loop) is the same code for every family.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "family_name",
    "family_of",
    "get_family",
    "moe_layers",
    "routed_experts",
]

FAMILIES = {
    "qwen3_moe": "moeshard.models.qwen3moe",
    "deepseek_v3": "moeshard.models.deepseekv3",
    "qwen3_5_moe_text": "moeshard.models.qwen35moe",
    "qwen3_5_moe": "moeshard.models.qwen35moe",  # the Hub's vision-language folders: their language model
    "gpt_oss": "moeshard.models.gptoss",
}
"""``model.family`` → the package that implements it (its ``FAMILY``)."""
DEFAULT_FAMILY = "qwen3_moe"
"""The family of a preset job that names none."""


def get_family(name: str):
    """The ``ModelFamily`` of ``name`` (``qwen3_moe``, ``deepseek_v3``, ``qwen3_5_moe_text`` / ``qwen3_5_moe``,
    ``gpt_oss``).

    Raises:
        ValueError: an unknown family, naming the choices.
    """
    if name not in FAMILIES:
        raise ValueError(
            f"model.family={name!r} is not a model family this job trains; choose one of {sorted(FAMILIES)}"
        )
    return importlib.import_module(FAMILIES[name]).FAMILY


def family_of(model_config: Any):
    """The ``ModelFamily`` of a transformers config (by its ``model_type``)."""
    return get_family(getattr(model_config, "model_type", None))


def family_name(family: str | None, path: str | None) -> str:
    """``model.family`` when given, else the ``model_type`` of ``path``'s ``config.json`` when it names a family we
    train, else :data:`DEFAULT_FAMILY` (a folder of another architecture is refused by its family's loader)."""
    if family is not None:
        return family
    if path is not None:
        try:
            model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None  # the loader reports a missing or broken config.json in its own words
        if model_type in FAMILIES:
            return model_type
    return DEFAULT_FAMILY


def routed_experts(model_config: Any) -> int:
    """Routed experts per MoE layer of a config, whatever the family names the field (``hf_format.num_experts``)."""
    return family_of(model_config).hf_format.num_experts(model_config)


def moe_layers(model_config: Any) -> int:
    """Decoder layers with routed experts, by the family's rule (``mlp_only_layers``, ``first_k_dense_replace``)."""
    decoder = family_of(model_config).model_class.base_model_class
    return sum(1 for i in range(model_config.num_hidden_layers) if decoder.is_moe_layer(model_config, i))
