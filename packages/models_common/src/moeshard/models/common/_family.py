"""A model family as one value: what a trainer needs to build, load, count and plan any family's model.

from moeshard.models.deepseekv3 import FAMILY
config = FAMILY.preset_config("deepseek-v3-16b", num_hidden_layers=4)     # or FAMILY.load_config(path)
with torch.device("meta"):
    model = FAMILY.model_class(config)
total, active = FAMILY.count_parameters(config)                          # derived from the model: model_facts
width = FAMILY.facts(config).expert_width
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from moeshard.models.common._facts import ModelFacts, model_facts
from moeshard.models.common._hf_load import HFFormat, load_hf_config

__all__ = ["ModelFamily"]


@dataclass(frozen=True)
class ModelFamily:
    """One model family's entry points (each family package exports its ``FAMILY``).

    Its facts (parameter and FLOP counts, activation sizes, expert shapes) are derived from its model
    (:func:`model_facts`), so a family writes no formula and a trainer reads no config field name.

    Attributes:
        model_class: the causal LM class (``model_class(config)``; its ``hf_format`` describes its checkpoints).
        presets: preset name → config fields.
        preset_config: ``preset_config(name, **overrides) -> config`` (``ValueError`` for an unknown name or field).
    """

    model_class: type[nn.Module]
    presets: Mapping[str, Mapping[str, Any]]
    preset_config: Callable[..., PretrainedConfig]

    @property
    def name(self) -> str:
        """The family's name, its configs' ``model_type`` (``"qwen3_moe"``, ``"deepseek_v3"``)."""
        return self.hf_format.model_type

    @property
    def structural_keys(self) -> tuple[str, ...]:
        """Config fields that decide parameter shapes."""
        return self.hf_format.structural_keys

    @property
    def hf_format(self) -> HFFormat:
        """The family's checkpoint format (its model class's ``hf_format``)."""
        return self.model_class.hf_format

    def load_config(self, path: str | os.PathLike) -> PretrainedConfig:
        """The checked config of a local HF checkpoint folder of this family (see ``load_hf_config``)."""
        return load_hf_config(path, self.hf_format)

    def facts(self, config: PretrainedConfig) -> ModelFacts:
        """The :class:`ModelFacts` of this family's model for ``config`` (built on the meta device)."""
        return model_facts(self.model_class, config)

    def count_parameters(self, config: PretrainedConfig) -> tuple[int, int]:
        """``(total, active per token)`` parameters of the causal LM for ``config`` (see :class:`ModelFacts`)."""
        facts = self.facts(config)
        return facts.parameters, facts.active_parameters

    def flops_per_token(self, config: PretrainedConfig, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) at ``seq_len``: 6 x the matmul parameters a token
        passes through plus causal attention's score and value products (:meth:`ModelFacts.flops_per_token`)."""
        return self.facts(config).flops_per_token(seq_len)
