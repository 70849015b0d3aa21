"""Our model against transformers' Qwen3MoeForCausalLM on the same checkpoint, float32."""

from __future__ import annotations

import collections

import pytest
import torch

from moeshard.models.common import apply_activation_checkpointing
from moeshard.models.common.testing import max_rel_grad_error
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padding"])
def test_logits_losses_and_grads_match_transformers(hf_dir, batch, load_reference, padded):
    ids, mask, labels = batch
    attention_mask = mask if padded else None
    if not padded:
        labels = ids
    ref = load_reference(hf_dir)
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]

    out_ref = ref(input_ids=ids, labels=labels, attention_mask=attention_mask)
    out = ours(ids, labels=labels, attention_mask=attention_mask)
    keep = mask.bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(out.logits[keep], out_ref.logits[keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=0, atol=1e-5)
    assert len(out.router_logits) == 2  # the dense layer has no router

    out_ref.loss.backward()
    out.loss.backward()
    worst, where = max_rel_grad_error(ref, ours)
    assert worst < 1e-4, f"gradient of {where} differs by {worst:.2e} (relative)"


def test_num_items_in_batch_and_no_router_logits(hf_dir, batch, load_reference):
    ids, mask, labels = batch
    ref, ours = load_reference(hf_dir), Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    n = torch.tensor(37)
    kwargs = dict(labels=labels, attention_mask=mask, num_items_in_batch=n, output_router_logits=False)
    out_ref = ref(input_ids=ids, **kwargs)
    out = ours(ids, **kwargs)
    assert out.aux_loss is None and out.router_logits is None
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=0, atol=1e-5)
    # sum / N: 20 label tokens after the shift, so the mean differs from the sum over 37
    mean = ours(ids, labels=labels, attention_mask=mask, output_router_logits=False).loss
    torch.testing.assert_close(out.loss, mean * 19 / 37, rtol=1e-5, atol=0)


def test_logits_without_labels(hf_dir, batch):
    ids, _, _ = batch
    out = Qwen3MoeForCausalLM.from_pretrained(hf_dir)(ids)
    assert out.loss is None and out.logits.shape == (2, 12, 512)


# Qwen3-MoE's attention (q/k norms) under full checkpointing that keeps it; every mode of it, the second backward
# and the FlashAttention 4 choice are moeshard.models.common's tests on its toy family.
@pytest.mark.parametrize("padded,keep_attention", [(False, True)], ids=["kept"])
def test_activation_checkpointing_same_loss_and_grads(hf_dir, batch, monkeypatch, padded, keep_attention):
    import moeshard.models.common._kept as kept

    ids, mask, labels = batch
    mask = mask if padded else None
    plain, ac = Qwen3MoeForCausalLM.from_pretrained(hf_dir), Qwen3MoeForCausalLM.from_pretrained(hf_dir)
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
    layers, moe = ac.config.num_hidden_layers, len(ac.config.mlp_only_layers or ())
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


@pytest.mark.parametrize("expert_layout", ["per_expert", "fused"])
def test_our_save_loads_in_transformers(hf_dir, batch, load_reference, tmp_path, expert_layout):
    ids, mask, _ = batch
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    # A few kB per shard: several shards plus the index
    ours.save_pretrained(tmp_path / "out", max_shard_size="100KB", expert_layout=expert_layout)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    ref = load_reference(tmp_path / "out")
    torch.testing.assert_close(
        ref(input_ids=ids, attention_mask=mask).logits[mask.bool()],
        ours(ids, attention_mask=mask).logits[mask.bool()],
        rtol=0,
        atol=1e-5,
    )


def test_bfloat16_close_to_transformers(hf_dir, batch):
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    ids, mask, labels = batch
    ref = HFQwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.bfloat16)
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    out_ref, out = ref(input_ids=ids, labels=labels, attention_mask=mask), ours(ids, labels=labels, attention_mask=mask)
    assert out.logits.dtype == torch.bfloat16
    # a couple of bf16 ulps: the experts apply routing weights in float32, transformers in bf16
    torch.testing.assert_close(out.logits[mask.bool()], out_ref.logits[mask.bool()], rtol=0, atol=2e-2)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=0, atol=1e-2)
    torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=0, atol=1e-2)


def test_bfloat16_gradients_follow_transformers(hf_dir):
    # The training path (the chunked loss head) in bf16 rounds the loss's gradient where transformers does:
    # (softmax - one-hot) / N formed in float32 and rounded once at the logits. Each large parameter's gradient norm
    # then follows transformers' bf16 model (median 3e-4 off, at most 2e-3 here). The divisor taken in bf16 after
    # the rounding (the head before moeshard-models-common 0.1.16) put them 0.5-0.7% off at N = 1003, which bf16
    # cannot hold. (Parameters of 64 elements or fewer differ by up to 1% either way: too few to average.)
    import statistics

    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    ids = torch.randint(1, 512, (8, 64), generator=torch.Generator().manual_seed(5))
    ref = HFQwen3MoeForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=torch.bfloat16)
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    ref(input_ids=ids, labels=ids, num_items_in_batch=1003).loss.backward()
    ours(ids, labels=ids, num_items_in_batch=1003, return_logits=False).loss.backward()
    grads = dict(ref.named_parameters())
    off = {
        n: abs(float(p.grad.double().norm() / grads[n].grad.double().norm()) - 1)
        for n, p in ours.named_parameters()
        if p.numel() >= 2048
    }
    assert len(off) >= 15 and statistics.median(off.values()) < 1e-3, off
    assert max(off.values()) < 4e-3, off
