"""Packed rows with ``document_ids`` against transformers running every document on its own (float32, CPU):
logits of every token, the mean loss over the predicted tokens, and the gradients of every parameter. The masks
themselves and the packed rows against the same model per document are ``moeshard.models.common``'s tests."""

from __future__ import annotations

import pytest

from moeshard.models.common.testing import check_packed_documents
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_packed_documents_match_transformers_per_document(hf_dir, load_reference, kind):
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    ours.model.document_attention = kind
    # flex_attention has no backward on CPU: the flex path is checked forward only here (CUDA tests train it).
    check_packed_documents(ours, load_reference(hf_dir), backward=kind == "dense")
