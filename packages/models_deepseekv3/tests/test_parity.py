"""Our DeepSeek-V3 against transformers' DeepseekV3ForCausalLM on the same checkpoint, float32: logits, loss and
every gradient, with group-limited routing, the correction bias, shared experts and a dense layer exercised."""

from __future__ import annotations

import pytest
import torch

from moeshard.models.common import GroupLimitedRouter
from moeshard.models.common.testing import max_rel_grad_error
from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM, DeepseekV3MoE


def _check(ref, ours, ids, labels, attention_mask):
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    out_ref = ref(input_ids=ids, labels=labels, attention_mask=attention_mask)
    out = ours(ids, labels=labels, attention_mask=attention_mask, output_router_logits=False)
    keep = attention_mask.bool() if attention_mask is not None else torch.ones_like(ids, dtype=torch.bool)
    torch.testing.assert_close(out.logits[keep], out_ref.logits[keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=0, atol=1e-5)
    out_ref.loss.backward()
    out.loss.backward()
    worst, where = max_rel_grad_error(ref, ours)
    assert worst < 1e-4, f"gradient of {where} differs by {worst:.2e} (relative)"


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padding"])
def test_logits_loss_and_grads_match_transformers(hf_dir, batch, load_reference, padded):
    ids, mask, labels = batch
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    biases = [m.e_score_correction_bias for m in ours.modules() if isinstance(m, GroupLimitedRouter)]
    assert len(biases) == 2 and all(b.abs().min() > 0 for b in biases)  # loaded, and not zero
    _check(load_reference(hf_dir), ours, ids, labels if padded else ids, mask if padded else None)


def test_the_bias_and_the_groups_change_the_selection(hf_dir, batch):
    """The fixture exercises what it claims: without the bias, or with all groups kept, other experts win."""
    ids, _, _ = batch
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    router = ours.model.layers[1].mlp.gate
    x_TD = torch.randn(64, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    scores_TE = router.scores(torch.nn.functional.linear(x_TD, router.weight))
    chosen = router.select(scores_TE).sort(-1).values
    bias = router.e_score_correction_bias.clone()
    router.e_score_correction_bias.zero_()
    assert not torch.equal(router.select(scores_TE).sort(-1).values, chosen)
    router.e_score_correction_bias.copy_(bias)
    router.topk_group = router.n_group
    assert not torch.equal(router.select(scores_TE).sort(-1).values, chosen)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 5e4}, n_shared_experts=2, first_k_dense_replace=2),
    ],
    ids=["no-q-lora-plain-rope-one-group", "default-rope-2-shared-2-dense"],
)
def test_variants_match_transformers(tmp_path, batch, load_reference, save_reference, overrides):
    ids, mask, labels = batch
    path = save_reference(tmp_path / "hf", seed=5, **overrides)
    _check(load_reference(path), DeepseekV3ForCausalLM.from_pretrained(path), ids, labels, mask)


def test_softmax_scoring_follows_its_formula(tiny_hf_config):
    """transformers' DeepSeek-V3 scores with a sigmoid only; softmax scoring (V2, TorchTitan's 16B) against the
    formula: softmax of the float32 logits, top-k without bias or groups here, unnormalised, scaled."""
    config = tiny_hf_config(scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False)
    router = DeepseekV3MoE(config).gate
    assert isinstance(router, GroupLimitedRouter) and router.scoring_func == "softmax"
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    x_TD = torch.randn(10, config.hidden_size, generator=g)
    logits, weights, ids = router(x_TD)
    probs = (x_TD @ router.weight.t()).softmax(-1)
    want_w, want_ids = probs.topk(config.num_experts_per_tok, dim=-1)
    order = ids.argsort(-1)
    torch.testing.assert_close(ids.gather(1, order), want_ids.sort(-1).values)
    torch.testing.assert_close(
        weights.gather(1, order), probs.gather(1, want_ids.sort(-1).values) * config.routed_scaling_factor
    )
    assert logits.dtype == weights.dtype == torch.float32


def test_logits_without_labels_and_aux_loss(hf_dir, batch):
    ids, mask, labels = batch
    ours = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    out = ours(ids)
    assert out.loss is None and out.logits.shape == (2, 12, 512)
    with_aux = ours(ids, labels=labels, attention_mask=mask, output_router_logits=True)
    plain = ours(ids, labels=labels, attention_mask=mask, output_router_logits=False)
    assert len(with_aux.router_logits) == 2 and with_aux.aux_loss > 0  # the dense layer has no router
    torch.testing.assert_close(with_aux.loss, plain.loss)  # router_aux_loss_coef is 0 unless the config sets it


def test_activation_checkpointing_same_loss_and_grads(hf_dir, batch):
    """Full checkpointing recomputes each layer without the routed experts' down projections and combine (their
    output only flows into the shared experts' and the residual's additions): the same loss and gradients, bit for
    bit, with a dense layer, shared experts and the router's aux loss in the graph."""
    from moeshard.models.common import apply_activation_checkpointing

    ids, mask, labels = batch
    plain, ac = DeepseekV3ForCausalLM.from_pretrained(hf_dir), DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    apply_activation_checkpointing(ac)
    losses = []
    for model in (plain, ac):
        out = model(ids, labels=labels, attention_mask=mask, output_router_logits=True)
        (out.loss + out.aux_loss).backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), ac.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
