"""The model's loss through the chunked head (``return_logits=False``) equals the plain path, loss and gradients."""

from __future__ import annotations

import torch


def test_model_loss_without_logits_equals_plain_path():
    from moeshard.models.common.testing import ToyConfig, ToyForCausalLM

    torch.manual_seed(0)
    model = ToyForCausalLM(ToyConfig(num_hidden_layers=2, dense_layers=[]))
    model.init_weights()
    ids = torch.randint(0, 512, (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(ids, labels=labels, num_items_in_batch=7.0, output_router_logits=True, return_logits=return_logits)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert (out.logits is None) == (not return_logits)
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
