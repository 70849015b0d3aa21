"""DeepSeek-V3 causal LM: MLA decoder layers, dense first layers, MoE layers with shared experts.

The decoder stack, the LM head with its chunked loss, the losses, init, the parallel plan and the HF load/save
face are the ones every family shares (``moeshard.models.common.MoECausalLM``); this file says only what DeepSeek-V3 builds in
each layer and how its checkpoints look. Parallelism is applied from outside, by the same ``parallelize``.

    model = DeepseekV3ForCausalLM.from_pretrained("/ckpt/Moonlight-16B-A3B", dtype=torch.bfloat16)
    out = model(input_ids, labels=input_ids)          # out.loss, out.logits

    with torch.device("meta"):                        # sharded training: build, parallelise, then fill
        model = DeepseekV3ForCausalLM(get_preset_config("deepseek-v3-16b"))
    par = parallelize(model, meshes, ParallelOptions(compile=True))
    model.to_empty(device="cuda")
    model.init_weights()                              # or load_hf_weights(model, path, ep_info=par.ep_info)
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from moeshard.models.common import DecoderModel, HFFormat, MoECausalLM
from moeshard.models.deepseekv3._layers import MLAttention
from moeshard.models.deepseekv3._moe import DeepseekV3MoE
from moeshard.models.deepseekv3._presets import MODEL_TYPE, check_config, is_moe_layer

__all__ = ["DEEPSEEK_V3_FORMAT", "STRUCTURAL_CONFIG_KEYS", "DeepseekV3ForCausalLM", "DeepseekV3Model"]

STRUCTURAL_CONFIG_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
)
"""Config fields that decide parameter shapes (a checkpoint or resume that differs in one is refused by name)."""


def _mtp_layers(config: DeepseekV3Config) -> range:
    # Multi-token-prediction modules are stored as layers after the last decoder layer (model.layers.61.* in V3).
    n = config.num_hidden_layers
    return range(n, n + max(int(getattr(config, "num_mtp_layers", 0) or 0), 1))


DEEPSEEK_V3_FORMAT = HFFormat(
    model_type=MODEL_TYPE,
    architecture="DeepseekV3ForCausalLM",
    config_class=DeepseekV3Config,
    check_config=check_config,
    structural_keys=STRUCTURAL_CONFIG_KEYS,
    num_experts=lambda config: config.n_routed_experts,
    buffers=(".mlp.gate.e_score_correction_bias",),
    skipped_layers=_mtp_layers,
)
"""DeepSeek-V3's Hub checkpoints: the router's correction bias is stored; MTP layers are skipped on load."""


class DeepseekV3Model(DecoderModel):
    """Embeddings, decoder layers (MLA, then dense MLPs up to ``first_k_dense_replace``, then the MoE block with its
    shared experts) and the final norm."""

    attention_class = MLAttention
    moe_block_class = DeepseekV3MoE
    is_moe_layer = staticmethod(is_moe_layer)


class DeepseekV3ForCausalLM(MoECausalLM):
    """DeepSeek-V3 causal LM with transformers' FQNs, numerics and ``from_pretrained``/``save_pretrained`` face.

    ``forward`` returns the LM loss and, with router logits, the load-balancing loss of the router logits
    (transformers' ``load_balancing_loss_func``, as for Qwen3-MoE) added with ``router_aux_loss_coef`` (a config
    field transformers' DeepSeek-V3 does not have: 0 unless set, so the loss is transformers'). Aux-loss-free
    balancing moves the routers' ``e_score_correction_bias``.

    Args:
        config: a ``transformers.DeepseekV3Config`` (see ``get_preset_config``); checked by ``check_config``.
    """

    base_model_class = DeepseekV3Model
    hf_format = DEEPSEEK_V3_FORMAT
