"""Packed rows with ``document_ids`` against transformers running every document on its own (float32, CPU):
logits of every token, the mean loss over the predicted tokens, and the gradients of every parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeshard.models.qwen3moe import Qwen3MoeForCausalLM
from moeshard.models.qwen3moe.layers import document_block_mask, document_causal_mask

S = 24
LENGTHS = [5, 11, 3, 20, 7, 2, 16, 4]  # several per row, one across a row boundary, one longer than most rows


def _pack(vocab: int):
    """Rows of ``S`` tokens cut from the documents back to back; each run of one document inside a row is a
    piece: positions restart, ids count pieces in the row, the piece's first token is not a target."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]
    stream = torch.cat(docs)
    owner = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    rows = stream.numel() // S
    ids, owner = stream[: rows * S].view(rows, S), owner[: rows * S].view(rows, S)
    new_piece = torch.ones_like(owner, dtype=torch.bool)
    new_piece[:, 1:] = owner[:, 1:] != owner[:, :-1]
    document_ids = new_piece.long().cumsum(1) - 1
    position_ids = torch.zeros_like(ids)
    for r in range(rows):
        for t in range(1, S):
            position_ids[r, t] = 0 if new_piece[r, t] else position_ids[r, t - 1] + 1
    labels = ids.masked_fill(new_piece, -100)
    pieces = [
        (r, int(a), int(a) + int((document_ids[r] == d).sum()))
        for r in range(rows)
        for d in document_ids[r].unique()
        for a in [(document_ids[r] == d).nonzero()[0, 0]]
    ]
    return ids, labels, position_ids, document_ids, pieces


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_packed_documents_match_transformers_per_document(hf_dir, load_reference, kind):
    ref = load_reference(hf_dir)
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    ours.model.document_attention = kind
    ids, labels, position_ids, document_ids, pieces = _pack(ref.config.vocab_size)
    assert len(pieces) > ids.shape[0]  # several documents per row

    # flex_attention has no backward on CPU: the flex path is checked forward only here (CUDA tests train it).
    with torch.set_grad_enabled(kind == "dense"):
        out = ours(ids, labels=labels, position_ids=position_ids, document_ids=document_ids, output_router_logits=False)
    n_targets = int((labels[:, 1:] != -100).sum())
    ref_sum = torch.zeros(())
    for r, a, b in pieces:
        piece = ids[r : r + 1, a:b]
        lg = ref(input_ids=piece).logits
        torch.testing.assert_close(out.logits[r : r + 1, a:b], lg, rtol=0, atol=1e-5)
        ref_sum = ref_sum + F.cross_entropy(lg[0, :-1], piece[0, 1:], reduction="sum")
    ref_loss = ref_sum / n_targets
    torch.testing.assert_close(out.loss, ref_loss, rtol=0, atol=1e-5)
    if kind == "flex":
        return

    out.loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        g_ref = ref_params[name].grad
        if g_ref is None:  # an expert no token of any document reached
            assert p.grad is None or not p.grad.any(), name
            continue
        err = ((p.grad - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-4, f"gradient of {name} differs by {err:.2e} (relative)"


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


def test_document_ids_of_the_wrong_shape_are_refused(hf_dir):
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    ids = torch.ones(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="document_ids must be"):
        ours(ids, document_ids=torch.zeros(1, 5, dtype=torch.long))
    ours.model.document_attention = "sparse"
    with pytest.raises(ValueError, match="document_attention must be"):
        ours(ids, document_ids=torch.zeros(1, 6, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex_attention (forward and backward) needs CUDA")
def test_flex_kernel_matches_the_dense_mask_on_cuda(hf_dir):
    ids, labels, position_ids, document_ids, _ = _pack(512)
    args = [t.cuda() for t in (ids, labels, position_ids, document_ids)]
    results = {}
    for kind in ("flex", "dense"):
        model = Qwen3MoeForCausalLM.from_pretrained(hf_dir, device="cuda")
        model.model.document_attention = kind
        if kind == "flex":  # the fused kernel runs compiled, as parallelize(compile=True) compiles the attention half
            for layer in model.model.layers:
                layer.attention_half = torch.compile(layer.attention_half)
        out = model(args[0], labels=args[1], position_ids=args[2], document_ids=args[3], output_router_logits=False)
        out.loss.backward()
        results[kind] = (out.logits.detach(), out.loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad)
    for got, want in zip(results["flex"], results["dense"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
