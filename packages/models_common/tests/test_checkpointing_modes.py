"""Activation checkpointing's modes (kept attention, recomputed, padded), a second backward, and the FlashAttention 4
kernel choice, each against the plain model, on the toy family (float32, CPU)."""

from __future__ import annotations

import collections

import pytest
import torch

from moeshard.models.common import AttentionOptions, apply_activation_checkpointing
from moeshard.models.common.testing import ToyForCausalLM, max_rel_grad_error, reference_fa4


@pytest.mark.parametrize(
    "padded,keep_attention", [(True, True), (False, True), (False, False)], ids=["padded", "kept", "recomputed"]
)
def test_activation_checkpointing_same_loss_and_grads(toy_dir, batch, monkeypatch, padded, keep_attention):
    import moeshard.models.common._kept as kept

    ids, mask, labels = batch
    mask = mask if padded else None
    plain, ac = ToyForCausalLM.from_pretrained(toy_dir), ToyForCausalLM.from_pretrained(toy_dir)
    # from outside the model, as parallelize does
    apply_activation_checkpointing(ac, keep_attention=keep_attention)
    names = [n for n, _ in ac.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]  # FQNs unchanged (FSDP / the plan rely on them)
    loss_plain = plain(ids, labels=labels, attention_mask=mask).loss
    runs, compute, pops, pop = [], kept._compute, collections.Counter(), kept.AttentionKeep._replay
    monkeypatch.setattr(kept, "_compute", lambda *a: runs.append(1) or compute(*a))
    monkeypatch.setattr(kept.AttentionKeep, "_replay", lambda self, op, *a: pops.update([op]) or pop(self, op, *a))
    loss_ac = ac(ids, labels=labels, attention_mask=mask).loss
    torch.testing.assert_close(loss_ac, loss_plain, rtol=0, atol=0)
    loss_plain.backward()
    loss_ac.backward()
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    # Kept: each layer's attention kernel ran in the forward only, not again in the recompute, which replayed it
    # and the output projection; the MoE layers' recompute replayed their routers' top-k. A padding mask (SDPA
    # with the mask) recomputes the attention and its projection; keep_attention=False recomputes all three.
    layers, moe = ac.config.num_hidden_layers, len(ac.config.dense_layers or ())
    moe = layers - moe
    attention = layers if keep_attention and not padded else 0
    assert len(runs) == attention
    assert dict(pops) == {
        k: v
        for k, v in [
            ("kept_causal_attention", attention),
            ("kept_linear", attention),
            ("kept_topk", moe if keep_attention else 0),
        ]
        if v
    }


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "kept"])
def test_fa4_kernel_gives_the_sdpa_model(toy_dir, batch, monkeypatch, checkpointed):
    """``AttentionOptions(kernel="fa4")`` (FlashAttention 4's entry points computed on CPU, ``reference_fa4``): the model's
    loss and gradients are the SDPA model's, one forward and one backward call per layer, also under full
    checkpointing that keeps the attention; without the package the model refuses it before its first layer."""
    ids, _, labels = batch
    sdpa, fa4 = ToyForCausalLM.from_pretrained(toy_dir), ToyForCausalLM.from_pretrained(toy_dir)
    with pytest.raises(ValueError, match="causal attention kernel must be one of"):
        AttentionOptions(kernel="flash")
    fa4.model.attention = AttentionOptions(kernel="fa4")
    with pytest.raises(ValueError, match="kernel 'fa4' cannot run here: .*set parallel.attention_kernel"):
        fa4(ids, labels=labels)
    calls = reference_fa4(monkeypatch)
    if checkpointed:
        apply_activation_checkpointing(fa4)
    loss_sdpa, loss_fa4 = sdpa(ids, labels=labels).loss, fa4(ids, labels=labels).loss
    torch.testing.assert_close(loss_fa4, loss_sdpa, rtol=1e-6, atol=1e-6)
    loss_sdpa.backward()
    loss_fa4.backward()
    worst, where = max_rel_grad_error(sdpa, fa4)
    assert worst < 1e-5, where
    layers = fa4.config.num_hidden_layers
    assert dict(calls) == {"forward": layers, "backward": layers}


def test_activation_checkpointing_backward_twice(toy_dir, batch):
    """A second backward through a retained graph recomputes each layer again: the kept outputs and the route are
    replayed from the first again, and the gradients are the same."""
    ids, _, _ = batch
    ac = ToyForCausalLM.from_pretrained(toy_dir)
    apply_activation_checkpointing(ac)
    params = [p for p in ac.parameters() if p.requires_grad]
    loss = ac(ids, labels=ids).loss
    first = torch.autograd.grad(loss, params, retain_graph=True)
    second = torch.autograd.grad(loss, params)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
