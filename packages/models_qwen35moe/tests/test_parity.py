"""Our model against transformers' Qwen3_5MoeForCausalLM on the same checkpoint, float32: logits, losses, every
gradient; packed documents against transformers run on each document alone."""

from __future__ import annotations

import pytest
import torch

from moeshard.models.common.testing import max_rel_grad_error
from moeshard.models.qwen35moe import GatedDeltaNet, Qwen35MoeForCausalLM


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padding"])
def test_logits_losses_and_grads_match_transformers(hf_dir, load_reference, padded):
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (2, 70))  # longer than a chunk of the delta rule (64)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    attention_mask = mask if padded else None
    ref, ours = load_reference(hf_dir), Qwen35MoeForCausalLM.from_pretrained(hf_dir)
    assert sorted(n for n, _ in ours.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    assert sum(isinstance(m, GatedDeltaNet) for m in ours.modules()) == 3

    out_ref = ref(input_ids=ids, labels=labels, attention_mask=attention_mask, output_router_logits=True)
    out = ours(ids, labels=labels, attention_mask=attention_mask, output_router_logits=True)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], out_ref.logits[keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=0, atol=1e-5)
    assert len(out.router_logits) == 4  # every layer has experts

    out_ref.loss.backward()
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst, where = max_rel_grad_error(ref, ours)
    # A_log's gradient is a sum over every token of products through the decay's cumulative sums (a small total of
    # large terms): float32 leaves a few 1e-4 of it between two orders of the same products.
    assert worst < 1e-3, f"gradient of {where} differs by {worst:.2e} (relative)"
    for name, p in ours.named_parameters():  # each one got a gradient, as transformers' did
        assert (p.grad is None) == (ref_grads[name] is None), name


def test_packed_documents_equal_each_document_alone(hf_dir, load_reference):
    """The DeltaNet's state and its convolution restart at each document (and attention is masked per document):
    a packed row gives what transformers gives for each document run alone."""
    torch.manual_seed(1)
    lengths = [[30, 3, 50], [83]]  # a document shorter than the convolution, one over a chunk boundary
    ref, ours = load_reference(hf_dir), Qwen35MoeForCausalLM.from_pretrained(hf_dir)
    ids = torch.randint(0, 512, (2, 83))
    docs = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    packed = ours(ids, document_ids=docs, position_ids=pos).logits
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            alone = ref(input_ids=ids[r : r + 1, start : start + n]).logits[0]
            torch.testing.assert_close(packed[r, start : start + n], alone, rtol=0, atol=2e-5)
            start += n
    ours(ids, labels=ids, document_ids=docs, position_ids=pos).loss.backward()  # the reference path has a backward
    assert all(p.grad is not None for p in ours.parameters() if p.requires_grad)


def test_init_weights_as_transformers_kinds():
    from moeshard.models.qwen35moe import get_preset_config

    model = Qwen35MoeForCausalLM(get_preset_config("tiny"))
    model.init_weights(torch.Generator().manual_seed(0))
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.zeros(64))  # zero-centred: (1 + w)
    assert torch.equal(layer.linear_attn.norm.weight, torch.ones(16))  # the gated norm: w
    a = layer.linear_attn.A_log.exp()
    assert ((a >= 0.01) & (a <= 16)).all() and torch.equal(layer.linear_attn.dt_bias, torch.ones(4))
    assert model.model.layers[3].mixer is model.model.layers[3].self_attn
