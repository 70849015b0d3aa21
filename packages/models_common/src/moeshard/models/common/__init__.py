"""moeshard.models.common: what every moeshard model family shares, so that a family says only what differs.

- HF checkpoints: a family describes its format once (:class:`HFFormat`, the model class's ``hf_format``);
  :func:`load_hf_weights` fills a plain, EP-sliced or FSDP-sharded model in place from either expert layout
  (per-expert Hub keys or fused), each rank reading only its slices, the whole plan checked before the first byte
  (FP8 block-scaled weights dequantised, skipped layers named in one line); :func:`save_hf_weights` /
  :func:`stream_hf_weights` / :func:`save_hf_checkpoint` write folders transformers loads.
- :class:`ModelFamily`: a family's entry points as one value (each family package exports its ``FAMILY``), so a
  trainer picks a family by name and knows no family.
- The LM head's chunked loss: :func:`linear_cross_entropy` never holds the ``[tokens, vocab]`` logits.

    from moeshard.models.common import load_hf_weights
    report = load_hf_weights(model, "/ckpt/Moonlight-16B-A3B")      # any family's model
"""

from moeshard.models.common._family import ModelFamily
from moeshard.models.common._hf_load import (
    HFFormat,
    LoadReport,
    load_hf_config,
    load_hf_weights,
    local_region,
    model_format,
)
from moeshard.models.common._hf_save import (
    EXPERT_LAYOUTS,
    parse_size,
    save_hf_checkpoint,
    save_hf_weights,
    stream_hf_weights,
)
from moeshard.models.common._lm_loss import IGNORE_INDEX, ce_chunk, linear_cross_entropy
from moeshard.models.common._presets import config_keys, preset_config
from moeshard.models.common._safetensors import INDEX_NAME, CheckpointError, SafetensorsDir, TensorInfo

__all__ = [
    "EXPERT_LAYOUTS",
    "IGNORE_INDEX",
    "INDEX_NAME",
    "CheckpointError",
    "HFFormat",
    "LoadReport",
    "ModelFamily",
    "SafetensorsDir",
    "TensorInfo",
    "ce_chunk",
    "config_keys",
    "linear_cross_entropy",
    "load_hf_config",
    "load_hf_weights",
    "local_region",
    "model_format",
    "parse_size",
    "preset_config",
    "save_hf_checkpoint",
    "save_hf_weights",
    "stream_hf_weights",
]
