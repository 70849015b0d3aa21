"""Evaluation on Qwen3-MoE: the mean token loss equals transformers'. The balancing pieces (router bias, counts,
losses, the bias update, counts over ranks) are ``moeshard.models.common``'s tests."""

from __future__ import annotations

import pytest
import torch

from moeshard.models.qwen3moe import Qwen3MoeForCausalLM


def test_evaluate_is_the_mean_token_loss_of_transformers(hf_dir, batch, load_reference):
    from types import SimpleNamespace

    from moeshard.models.common import evaluate

    ids, mask, labels = batch
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ours.train()
    ref = load_reference(hf_dir)

    def mb(rows):
        return SimpleNamespace(
            input_ids=ids[rows],
            labels=labels[rows],
            attention_mask=mask[rows],
            position_ids=None,
            document_ids=None,
            to=lambda device, non_blocking=False: mb(rows),
        )

    result = evaluate(ours, [mb([0]), mb([1])])
    assert ours.training  # restored
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = labels[:, 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert result.tokens == int((targets != -100).sum())
    assert result.loss == pytest.approx(float(want), rel=1e-5) and result.ppl == pytest.approx(float(want.exp()))
