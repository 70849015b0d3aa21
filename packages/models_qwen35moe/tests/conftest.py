"""Shared fixtures: tiny random transformers Qwen3.5-MoE models saved with ``save_pretrained`` (the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM as HFQwen35MoeForCausalLM

from moeshard.models.qwen35moe import get_preset_config


def _reference(seed: int = 1234) -> HFQwen35MoeForCausalLM:
    torch.manual_seed(seed)
    ref = HFQwen35MoeForCausalLM(get_preset_config("tiny", output_router_logits=True)).float()
    with torch.no_grad():  # norms are zero-centred (0 at init): give them values, so a wrong kind shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    return ref


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """Directory of a random tiny transformers ``Qwen3_5MoeForCausalLM`` (text folder, per-expert keys)."""
    path = tmp_path_factory.mktemp("hf_tiny_qwen35")
    _reference().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def load_reference():
    """``load_reference(path)``: the transformers model saved at ``path``, SDPA attention, float32."""
    return lambda path: HFQwen35MoeForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
