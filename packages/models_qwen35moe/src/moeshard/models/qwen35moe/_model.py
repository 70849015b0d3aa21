"""Qwen3.5-MoE causal LM: per ``layer_types`` a Gated DeltaNet or a gated attention layer, then the MoE block with
routed experts and a sigmoid-gated shared expert; zero-centred RMSNorms.

The decoder stack, the LM head with its chunked loss, the losses, init, the parallel plan and the HF load/save
face are the ones every family shares (``moeshard.models.common.MoECausalLM``); this file says only what Qwen3.5-MoE
builds in each layer and how its checkpoints look. Parallelism is applied from outside, by the same
``parallelize``.

    model = Qwen35MoeForCausalLM.from_pretrained("/ckpt/Qwen3.5-35B-A3B", dtype=torch.bfloat16)  # VL folder too
    out = model(input_ids, labels=input_ids)          # out.loss, out.logits
"""

from __future__ import annotations

from torch import nn
from transformers import Qwen3_5MoeTextConfig

from moeshard.models.common import (
    DecoderModel,
    DenseMLP,
    Experts,
    FolderLayout,
    HFFormat,
    MoEBlock,
    MoECausalLM,
    TopKRouter,
    ZeroCenteredRMSNorm,
)
from moeshard.models.qwen35moe._layers import GatedAttention, GatedDeltaNet
from moeshard.models.qwen35moe._presets import MODEL_TYPE, VL_MODEL_TYPE, check_config, is_moe_layer

__all__ = [
    "QWEN35_FORMAT",
    "STRUCTURAL_CONFIG_KEYS",
    "Qwen35MoeForCausalLM",
    "Qwen35MoeModel",
    "Qwen35MoeSparseMoeBlock",
]

STRUCTURAL_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts",
    "layer_types",
)
"""Config fields that decide parameter shapes (a checkpoint or resume that differs in one is refused by name)."""


def _field(config: Qwen3_5MoeTextConfig, name: str) -> object:
    value = getattr(config, name, None)
    return list(value) if name == "layer_types" and value is not None else value


QWEN35_FORMAT = HFFormat(
    model_type=MODEL_TYPE,
    architecture="Qwen3_5MoeForCausalLM",
    config_class=Qwen3_5MoeTextConfig,
    check_config=check_config,
    structural_keys=STRUCTURAL_CONFIG_KEYS,
    num_experts=lambda config: config.num_experts,
    field=_field,
    layouts=(
        FolderLayout(
            model_type=VL_MODEL_TYPE,
            config_key="text_config",
            prefix=("model.", "model.language_model."),
            skipped=(("model.visual.", "the vision tower"), ("mtp.", "multi-token prediction")),
        ),
    ),
    skipped=(("mtp.", "multi-token prediction"),),
)
"""Qwen3.5-MoE's checkpoints: text-model folders (``qwen3_5_moe_text``, what export writes) and the Hub's
vision-language folders (``qwen3_5_moe``: the language model under ``model.language_model.``; the vision tower and
the multi-token-prediction weights are skipped with one logged line each)."""


class Qwen35MoeSparseMoeBlock(MoEBlock):
    """``mlp.gate`` (softmax top-k, renormalised), ``mlp.experts`` (sharded by EP like any others),
    ``mlp.shared_expert`` (a SwiGLU MLP of ``shared_expert_intermediate_size``) scaled per token by
    ``sigmoid(mlp.shared_expert_gate(x))``."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        d = config.hidden_size
        super().__init__(
            Experts(config.num_experts, d, config.moe_intermediate_size),
            TopKRouter(config.num_experts, d, config.num_experts_per_tok, norm_topk_prob=True),
            DenseMLP(d, config.shared_expert_intermediate_size),
            shared_name="shared_expert",
            shared_gate=nn.Linear(d, 1, bias=False),
        )


class Qwen35MoeModel(DecoderModel):
    """Embeddings, decoder layers (``linear_attn``: Gated DeltaNet, or ``self_attn``: gated attention, by
    ``config.layer_types``; then the MoE block) and the final norm, all norms zero-centred."""

    attention_class = GatedAttention
    moe_block_class = Qwen35MoeSparseMoeBlock
    is_moe_layer = staticmethod(is_moe_layer)
    norm_class = ZeroCenteredRMSNorm

    @classmethod
    def build_mixer(cls, config: Qwen3_5MoeTextConfig, layer_idx: int) -> tuple[str, nn.Module]:
        """``("linear_attn", GatedDeltaNet)`` or ``("self_attn", GatedAttention)`` by ``config.layer_types``."""
        if config.layer_types[layer_idx] == "linear_attention":
            return "linear_attn", GatedDeltaNet(config)
        return "self_attn", GatedAttention(config)


class Qwen35MoeForCausalLM(MoECausalLM):
    """Qwen3.5-MoE causal LM with transformers' FQNs, numerics and ``from_pretrained``/``save_pretrained`` face.

    FQNs as transformers' ``Qwen3_5MoeForCausalLM``: ``model.layers.{i}.linear_attn.*`` or ``...self_attn.*``,
    ``...mlp.gate.weight [E, D]``, ``...mlp.experts.{gate_up_proj, down_proj}``, ``...mlp.shared_expert.*``,
    ``...mlp.shared_expert_gate.weight [1, D]``, ``model.norm``, ``lm_head``.

    Args:
        config: a ``transformers.Qwen3_5MoeTextConfig`` (see ``get_preset_config``); checked by ``check_config``.
    """

    base_model_class = Qwen35MoeModel
    hf_format = QWEN35_FORMAT
