"""GPT-OSS causal LM: GQA attention with sinks (sliding-window or full by ``layer_types``), then the biased MoE block
with the clamped SwiGLU, in every layer.

The decoder stack, the LM head with its chunked loss, the losses, init and the HF load/save face are the ones every
family shares (``moeshard.models.common.MoECausalLM``); this file says what GPT-OSS builds in each layer, which mask
each layer gets, and which tensors its EP plan shards.

    model = GptOssForCausalLM(get_preset_config("tiny"))
    out = model(input_ids, labels=input_ids)          # out.loss, out.lm_loss, out.aux_loss, out.logits
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from transformers import GptOssConfig

from moeshard.ep import ParallelPlan
from moeshard.models.common import DecoderLayer, DecoderModel, HFFormat, MoECausalLM
from moeshard.models.gptoss._checkpoint import HUB_LAYOUT
from moeshard.models.gptoss._layers import GptOssAttention, sliding_masks
from moeshard.models.gptoss._moe import GptOssMoE
from moeshard.models.gptoss._presets import MODEL_TYPE, check_config, is_moe_layer

__all__ = ["GPT_OSS_FORMAT", "STRUCTURAL_CONFIG_KEYS", "GptOssForCausalLM", "GptOssModel"]

STRUCTURAL_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_local_experts",
)
"""Config fields that decide parameter shapes (a checkpoint or resume that differs in one is refused by name)."""


def _gpt_oss_format(**layouts) -> HFFormat:
    return HFFormat(
        model_type=MODEL_TYPE,
        architecture="GptOssForCausalLM",
        config_class=GptOssConfig,
        check_config=check_config,
        structural_keys=STRUCTURAL_CONFIG_KEYS,
        num_experts=lambda config: config.num_local_experts,
        stored=HUB_LAYOUT,
        **layouts,
    )


class GptOssModel(DecoderModel):
    """Embeddings, decoder layers (attention with sinks and the layer's window, then the MoE block) and the final
    norm. Each layer gets both masks (:func:`sliding_masks`) and takes its own layer type's."""

    attention_class = GptOssAttention
    moe_block_class = GptOssMoE
    is_moe_layer = staticmethod(is_moe_layer)

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config)
        self.sliding_window = int(config.sliding_window or 1)

    @classmethod
    def build_layer(cls, config: GptOssConfig, layer_idx: int) -> DecoderLayer:
        """Decoder layer ``layer_idx``: attention of its ``layer_types`` entry, then the MoE block."""
        attention = GptOssAttention(config, layer_idx)
        return DecoderLayer(attention, GptOssMoE(config), config.hidden_size, config.rms_norm_eps, layer_idx)

    def _attention_mask(self, attention_mask_BS, document_ids_BS, s, device):
        base = super()._attention_mask(attention_mask_BS, document_ids_BS, s, device)
        if document_ids_BS is not None and attention_mask_BS is not None:
            document_ids_BS = document_ids_BS.masked_fill(attention_mask_BS == 0, -1)
        return sliding_masks(base, self.sliding_window, document_ids_BS, s, device)


class GptOssForCausalLM(MoECausalLM):
    """GPT-OSS causal LM with transformers' FQNs (``model.layers.{i}.self_attn.{q,k,v,o}_proj`` with biases,
    ``...self_attn.sinks [H]``, ``...mlp.router.{weight,bias}``, ``...mlp.experts.{gate_up_proj,down_proj}`` and
    their ``_bias``), numerics and ``from_pretrained``/``save_pretrained`` face; Hub checkpoints in MXFP4 or bf16.

    Args:
        config: a ``transformers.GptOssConfig`` (see ``get_preset_config``); checked by ``check_config``.
    """

    base_model_class = GptOssModel
    hf_format = _gpt_oss_format()

    @staticmethod
    def get_parallel_plan() -> ParallelPlan:
        """The shared plan, with the experts' biases sharded on the expert dim beside their weights."""
        plan = MoECausalLM.get_parallel_plan()
        ep_plan = dict(plan.ep_plan)
        ep_plan["model.layers.*.mlp.experts.gate_up_proj_bias"] = Shard(0)
        ep_plan["model.layers.*.mlp.experts.down_proj_bias"] = Shard(0)
        return ParallelPlan(ep_plan=ep_plan, fsdp_units=plan.fsdp_units)


GPT_OSS_FORMAT = GptOssForCausalLM.hf_format
"""GPT-OSS's Hub checkpoints (``GptOssForCausalLM.hf_format``)."""
