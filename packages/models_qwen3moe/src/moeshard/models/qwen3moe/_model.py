"""Qwen3-MoE causal LM: GQA attention with q/k norm, then the sparse MoE block or a dense MLP in every layer.

The decoder stack, the LM head with its chunked loss, the losses, init, the parallel plan and the HF load/save face
are the ones every family shares (``moeshard.models.common.MoECausalLM``); this file says only what Qwen3-MoE builds
in each layer and how its checkpoints look.

    model = Qwen3MoeForCausalLM.from_pretrained("/ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids)          # out.loss, out.lm_loss, out.aux_loss, out.logits

    with torch.device("meta"):                        # sharded training: build, parallelise, then fill
        model = Qwen3MoeForCausalLM(get_preset_config("qwen3-30b-a3b"))
    par = parallelize(model, meshes, ParallelOptions(compile=True))
    model.to_empty(device="cuda")
    load_hf_weights(model, "/ckpt/Qwen3-30B-A3B", ep_info=par.ep_info)  # or model.init_weights()
"""

from __future__ import annotations

from moeshard.models.common import DecoderModel, MoECausalLM
from moeshard.models.qwen3moe._checkpoint import QWEN3_FORMAT
from moeshard.models.qwen3moe._layers import Attention
from moeshard.models.qwen3moe._moe import SparseMoeBlock
from moeshard.models.qwen3moe._presets import is_moe_layer

__all__ = ["Qwen3MoeForCausalLM", "Qwen3MoeModel"]


class Qwen3MoeModel(DecoderModel):
    """Embeddings, decoder layers (GQA attention, then the MoE block or a dense MLP) and the final norm."""

    attention_class = Attention
    moe_block_class = SparseMoeBlock
    is_moe_layer = staticmethod(is_moe_layer)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE causal LM with transformers' FQNs, numerics and ``from_pretrained``/``save_pretrained`` face.

    FQNs as transformers 5.x: ``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
    ``...self_attn.{q,k}_norm``, ``...mlp.gate.weight [E, D]``, ``...mlp.experts.gate_up_proj [E, 2F, D]``,
    ``...mlp.experts.down_proj [E, D, F]``, dense layers ``...mlp.{gate,up,down}_proj``, ``model.norm``,
    ``lm_head``.

    Args:
        config: a ``transformers.Qwen3MoeConfig`` (see ``get_preset_config``); checked by ``check_config``.
    """

    base_model_class = Qwen3MoeModel
    hf_format = QWEN3_FORMAT
