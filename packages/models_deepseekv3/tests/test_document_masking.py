"""Packed rows with ``document_ids`` against transformers' DeepSeek-V3 running every document on its own (MLA under
the same masks as Qwen3-MoE's attention): logits, the mean loss and every gradient, float32, CPU."""

from __future__ import annotations

import pytest

from moeshard.models.common.testing import check_packed_documents
from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_packed_documents_match_transformers_per_document(hf_dir, load_reference, kind):
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    ours.model.document_attention = kind
    # flex_attention has no backward on CPU: forward only there (MLA's value width differs from its key width).
    check_packed_documents(ours, load_reference(hf_dir), backward=kind == "dense")
