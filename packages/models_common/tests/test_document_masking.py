"""Document masking in the shared attention function, on the toy family: packed rows with ``document_ids`` against
the same model running every document on its own (float32, CPU): logits of every token, the mean loss over the
predicted tokens, and the gradients of every parameter; the dense and block masks agree; bad input is refused.
Agreement with transformers' models is each family's test."""

from __future__ import annotations

import pytest
import torch

from moeshard.models.common._layers import document_block_mask, document_causal_mask
from moeshard.models.common.testing import ToyForCausalLM, check_packed_documents, pack_documents


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_packed_documents_match_each_document_alone(toy_dir, kind):
    ours = ToyForCausalLM.from_pretrained(toy_dir)
    ours.model.document_attention = kind
    alone = ToyForCausalLM.from_pretrained(toy_dir)  # the reference: no documents, one document per call
    # flex_attention has no backward on CPU: the flex path is checked forward only here (CUDA tests train it).
    check_packed_documents(ours, alone, backward=kind == "dense")


def test_masks_agree_and_padding_is_its_own_document():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    dense = document_causal_mask(document_ids)
    assert dense.shape == (2, 1, 8, 8)
    assert dense[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert torch.equal(dense[1, 0], torch.ones(8, 8, dtype=torch.bool).tril())
    block = document_block_mask(document_ids)
    assert torch.equal(block.to_dense().bool()[:, :, :1, :1], torch.ones(2, 1, 1, 1, dtype=torch.bool))
    # the block mask's own element rule equals the dense mask
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(8), torch.arange(8), indexing="ij")
    assert torch.equal(block.mask_mod(b, None, q, kv), dense[:, 0])


def test_document_ids_of_the_wrong_shape_are_refused(toy_dir):
    ours = ToyForCausalLM.from_pretrained(toy_dir)
    ids = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="document_ids must be"):
        ours(ids, document_ids=torch.zeros(1, 5, dtype=torch.long))
    ours.model.document_attention = "sparse"
    with pytest.raises(ValueError, match="document_attention must be"):
        ours(ids, document_ids=torch.zeros(1, 6, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention (forward and backward) needs CUDA")
def test_flex_kernel_matches_the_dense_mask_on_cuda(toy_dir):
    ids, labels, position_ids, document_ids, _ = pack_documents(512)
    args = [t.cuda() for t in (ids, labels, position_ids, document_ids)]
    results = {}
    for kind in ("flex", "dense"):
        model = ToyForCausalLM.from_pretrained(toy_dir, device="cuda")
        model.model.document_attention = kind
        if kind == "flex":  # the fused kernel runs compiled, as parallelize(compile=True) compiles the attention half
            for layer in model.model.layers:
                layer.attention_half = torch.compile(layer.attention_half)
        out = model(args[0], labels=args[1], position_ids=args[2], document_ids=args[3], output_router_logits=False)
        out.loss.backward()
        results[kind] = (out.logits.detach(), out.loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad)
    for got, want in zip(results["flex"], results["dense"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
