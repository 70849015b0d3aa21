"""The functional attention half of a decoder layer (compiled as one graph on GPU) equals the module path."""

import pytest
import torch

from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config, kernels


@pytest.mark.parametrize("padded", [False, True])
def test_functional_attention_half_equals_module_path(padded, monkeypatch):
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(get_preset_config("tiny", num_hidden_layers=2))
    model.init_weights(torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
    results = []
    for functional in (False, True):
        # only the dispatch flag: the function runs eagerly here (same ops, same order: identical numbers)
        monkeypatch.setattr(kernels, "_COMPILED", [functional])
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, attention_mask=mask)
        out.loss.backward()
        results.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
