"""A model family as one value: what a trainer needs to build, load, count and plan any family's model.

from moeshard.models.deepseekv3 import FAMILY
config = FAMILY.preset_config("deepseek-v3-16b", num_hidden_layers=4)     # or FAMILY.load_config(path)
with torch.device("meta"):
    model = FAMILY.model_class(config)
total, active = FAMILY.count_parameters(config)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from moeshard.models.common._hf_load import HFFormat, load_hf_config

__all__ = ["ModelFamily"]


@dataclass(frozen=True)
class ModelFamily:
    """One model family's entry points (each family package exports its ``FAMILY``).

    Attributes:
        model_class: the causal LM class (``model_class(config)``; its ``hf_format`` describes its checkpoints).
        presets: preset name → config fields.
        preset_config: ``preset_config(name, **overrides) -> config`` (``ValueError`` for an unknown name or field).
        count_parameters: ``(total, active per token)`` of a config.
        flops_per_token: training FLOPs per token (forward and backward) of a config at a sequence length: 6 x the
            matmul parameters a token passes through plus causal attention's score and value products (see each
            family's ``flops_per_token``).
        activations_per_token: ``(attention, other MLP)`` elements a layer saves per token beyond its norms and
            routed copies (an estimate for planning memory; the other MLP: shared experts).
        kept_attention_per_token: ``(compute-dtype, float32)`` elements per token and layer that full activation
            checkpointing keeps beside the layer's input where it keeps the attention's output
            (``ParallelOptions.keep_attention``): the attention's output and log-sum-exp where its kernels apply
            (:func:`kept_attention_applies`), the output projection's output; None: not said (planned as
            ``(0, 0)``).
    """

    model_class: type[nn.Module]
    presets: Mapping[str, Mapping[str, Any]]
    preset_config: Callable[..., PretrainedConfig]
    count_parameters: Callable[[PretrainedConfig], tuple[int, int]]
    flops_per_token: Callable[[PretrainedConfig, int], float]
    activations_per_token: Callable[[PretrainedConfig], tuple[int, int]]
    kept_attention_per_token: Callable[[PretrainedConfig], tuple[int, int]] | None = None

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
