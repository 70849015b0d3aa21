"""moeshard.models.common: what every moeshard model family shares, so that a family says only what differs.

- The causal LM (:class:`MoECausalLM`, :class:`DecoderModel`, :class:`DecoderLayer`, :class:`LMHead` with the
  chunked loss :func:`linear_cross_entropy`): a family subclasses two classes and names its layers and checkpoints.
- The MoE block and its parts: :class:`MoEBlock` (router, routed :class:`Experts` through ``moeshard.ep``'s
  dispatchers, optional shared experts), the routers :class:`TopKRouter` (softmax top-k) and
  :class:`GroupLimitedRouter` (sigmoid/softmax, selection-only correction bias, group-limited top-k, scaling).
- Sequence mixers' hooks: a decoder layer's mixer of any kind (``DecoderModel.build_mixer``, ``mask_kind``), the
  linear-attention kernels (the gated delta rule and the short causal convolution, restarting per document:
  :func:`linear_attention_kernels`), the norm kind (:class:`ZeroCenteredRMSNorm`), gated shared experts
  (``MoEBlock(shared_gate=...)``).
- Dense blocks: :class:`RMSNorm`, :class:`RotaryEmbedding` (the config's RoPE scaling), :class:`DenseMLP`, the
  attention under a padding or packed-documents mask (:func:`attend`), with :class:`AttentionOptions` choosing its
  kernel and whether a checkpointed layer keeps its output for the recompute.
- :func:`parallelize` (EP, activation checkpointing, compile, FSDP2, prefetch; the ``parallel`` extra) and
  :class:`ParallelOptions`, for any family's model.
- Balancing: :class:`Balancing` with the hooks a loop calls (aux loss per micro-batch, global batch or sequence, z-loss,
  aux-loss-free bias update by DeepSeek-V3's rule), and its parts.
- HF checkpoints: a family describes its format once (:class:`HFFormat`, the model class's ``hf_format``);
  :func:`load_hf_weights` fills a plain, EP-sliced or FSDP-sharded model in place from either expert layout, each
  rank reading only its slices, the whole plan checked before the first byte (FP8 block-scaled weights
  dequantised, skipped layers named in one line; tensors a family stores in a layout of its own, quantised or not,
  converted by its :class:`StoredLayout`); :func:`save_hf_weights` / :func:`stream_hf_weights` /
  :func:`save_hf_checkpoint` write folders transformers loads.
- :class:`ModelFamily`: a family's entry points as one value (each family package exports its ``FAMILY``), so a
  trainer picks a family by name and knows none; its :class:`ModelFacts` (parameter and FLOP counts, activation
  sizes, expert shapes) are derived from the model built on the meta device (``ModelFamily.facts``), never written.

    from moeshard.models.common import load_hf_weights, parallelize
    par = parallelize(model, meshes)                                  # any family's model
    report = load_hf_weights(model, "/ckpt/Moonlight-16B-A3B", ep_info=par.ep_info)
"""

from moeshard.models.common._balancing import (
    SCOPES,
    Balancing,
    BalancingOptions,
    GlobalExpertCounts,
    StepBalance,
    expert_counts,
    global_balancing_loss,
    load_balancing_loss,
    router_z_loss,
    sequence_balancing_loss,
    update_router_bias,
)
from moeshard.models.common._causal_lm import DecoderLayer, DecoderModel, MoECausalLM
from moeshard.models.common._checkpointing import apply_activation_checkpointing
from moeshard.models.common._delta_rule import (
    DELTA_RULE_CHUNK,
    LinearAttentionKernels,
    RowSegments,
    causal_conv1d_reference,
    chunk_gated_delta_rule_reference,
    delta_rule_flops_per_token,
    linear_attention_kernels,
    linear_attention_row,
)
from moeshard.models.common._evaluation import EvalResult, evaluate
from moeshard.models.common._facts import ATTENTION_ATTRIBUTES, ModelFacts
from moeshard.models.common._family import ModelFamily
from moeshard.models.common._head import CausalLMOutput, LMHead, causal_lm_loss
from moeshard.models.common._hf_load import (
    FolderLayout,
    HFFormat,
    LoadReport,
    StoredLayout,
    load_hf_config,
    load_hf_weights,
    local_region,
)
from moeshard.models.common._hf_save import save_hf_checkpoint, save_hf_weights, stream_hf_weights
from moeshard.models.common._kept import CAUSAL_KERNELS, AttentionOptions
from moeshard.models.common._layers import (
    DenseMLP,
    RMSNorm,
    RotaryEmbedding,
    ZeroCenteredRMSNorm,
    apply_rotary,
    attend,
    attention_output,
)
from moeshard.models.common._lm_loss import IGNORE_INDEX, LOSS_CHUNK_TOKENS, ce_chunk, linear_cross_entropy
from moeshard.models.common._moe import (
    SCORING_FUNCS,
    Experts,
    GroupLimitedRouter,
    MoEBlock,
    Router,
    TopKRouter,
    routers,
)
from moeshard.models.common._parallel_options import ParallelOptions
from moeshard.models.common._parallelize import Parallelized, parallelize
from moeshard.models.common._presets import check_common_config, config_keys, preset_config
from moeshard.models.common._safetensors import CheckpointError, SafetensorsDir, TensorInfo
from moeshard.models.common._sequence_layout import SequenceLayout
from moeshard.models.common._sequence_parallel import ModelInputs, apply_sequence_parallel, model_inputs

__all__ = [
    "ATTENTION_ATTRIBUTES",
    "CAUSAL_KERNELS",
    "DELTA_RULE_CHUNK",
    "IGNORE_INDEX",
    "LOSS_CHUNK_TOKENS",
    "SCOPES",
    "SCORING_FUNCS",
    "AttentionOptions",
    "Balancing",
    "BalancingOptions",
    "CausalLMOutput",
    "CheckpointError",
    "DecoderLayer",
    "DecoderModel",
    "DenseMLP",
    "EvalResult",
    "Experts",
    "FolderLayout",
    "GlobalExpertCounts",
    "GroupLimitedRouter",
    "HFFormat",
    "LMHead",
    "LinearAttentionKernels",
    "LoadReport",
    "MoEBlock",
    "MoECausalLM",
    "ModelFacts",
    "ModelFamily",
    "ModelInputs",
    "ParallelOptions",
    "Parallelized",
    "RMSNorm",
    "Router",
    "RowSegments",
    "SequenceLayout",
    "RotaryEmbedding",
    "SafetensorsDir",
    "StepBalance",
    "StoredLayout",
    "TensorInfo",
    "TopKRouter",
    "ZeroCenteredRMSNorm",
    "apply_activation_checkpointing",
    "apply_sequence_parallel",
    "apply_rotary",
    "attend",
    "attention_output",
    "causal_conv1d_reference",
    "causal_lm_loss",
    "ce_chunk",
    "check_common_config",
    "chunk_gated_delta_rule_reference",
    "config_keys",
    "delta_rule_flops_per_token",
    "evaluate",
    "expert_counts",
    "global_balancing_loss",
    "linear_attention_kernels",
    "linear_attention_row",
    "linear_cross_entropy",
    "load_balancing_loss",
    "load_hf_config",
    "load_hf_weights",
    "local_region",
    "model_inputs",
    "parallelize",
    "preset_config",
    "router_z_loss",
    "routers",
    "save_hf_checkpoint",
    "save_hf_weights",
    "sequence_balancing_loss",
    "stream_hf_weights",
    "update_router_bias",
]
