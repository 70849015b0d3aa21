"""Shared fixtures: tiny random transformers DeepSeek-V3 models saved with ``save_pretrained`` (the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

from moeshard.models.common.testing import padded_batch

# 3 layers, the first dense; 8 routed experts in 4 groups (2 kept) top-2, one shared expert; query LoRA; YaRN RoPE
# with mscale; sigmoid scores with a correction bias (set non-zero below) and routed_scaling_factor 2.5.
TINY_HF = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 0.8,
        "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 128,
    },
    num_mtp_layers=0,
    pad_token_id=0,
)


def _tiny_hf_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**TINY_HF, **overrides})


def _load_reference(path) -> HFDeepseekV3ForCausalLM:
    return HFDeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def _save_reference(path, seed: int = 1234, **overrides):
    torch.manual_seed(seed)
    model = HFDeepseekV3ForCausalLM(_tiny_hf_config(**overrides))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_hf_config():
    """Factory of the reference config: ``tiny_hf_config(**overrides) -> DeepseekV3Config``."""
    return _tiny_hf_config


@pytest.fixture(scope="session")
def load_reference():
    """``load_reference(path)``: the transformers model saved at ``path``, SDPA attention, float32."""
    return _load_reference


@pytest.fixture(scope="session")
def save_reference():
    """``save_reference(path, seed=1234, **config_overrides) -> path``: a random transformers model, its correction
    biases set non-zero and spread (so that they change the selection), saved at ``path``."""
    return _save_reference


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """Directory of a random tiny transformers DeepseekV3ForCausalLM (per-expert keys, as transformers saves)."""
    return _save_reference(tmp_path_factory.mktemp("hf_tiny_dsv3"))


@pytest.fixture(scope="session")
def batch():
    """``(input_ids, attention_mask, labels)``: 2 sequences of 12, the second left-padded by 4."""
    return padded_batch()
