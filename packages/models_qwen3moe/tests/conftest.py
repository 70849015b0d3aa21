"""Shared fixtures: a tiny random transformers Qwen3-MoE saved with ``save_pretrained`` (the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from moeshard.models.common.testing import padded_batch

# 3 layers, the middle one dense (mlp_only_layers), 8 experts top-2, GQA 4/2, a padding token.
TINY_HF = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    rope_theta=1e6,
    max_position_embeddings=128,
    output_router_logits=True,
    pad_token_id=0,
)


def _tiny_hf_config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**TINY_HF, **overrides})


def _load_reference(path) -> HFQwen3MoeForCausalLM:
    return HFQwen3MoeForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_hf_config():
    """Factory of the reference config: ``tiny_hf_config(**overrides) -> Qwen3MoeConfig``."""
    return _tiny_hf_config


@pytest.fixture(scope="session")
def load_reference():
    """``load_reference(path)``: the transformers model saved at ``path``, SDPA attention, float32."""
    return _load_reference


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """Directory of a random tiny transformers Qwen3MoeForCausalLM (per-expert keys, as transformers saves)."""
    torch.manual_seed(1234)
    path = tmp_path_factory.mktemp("hf_tiny")
    HFQwen3MoeForCausalLM(_tiny_hf_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def batch():
    """``(input_ids, attention_mask, labels)``: 2 sequences of 12, the second left-padded by 4."""
    return padded_batch()
