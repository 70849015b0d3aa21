"""LoRA on GPT-OSS's experts: the adapters of the fused expert tensors go through the expert pass beside the experts'
biases and the clamped SwiGLU. The adapted tiny model equals the base with the adapters merged into its expert
weights (logits), and training reaches the adapters only (float32, CPU, one process)."""

import copy

import torch

from moeshard.lora import LoraOptions, apply_lora, merged_weights
from moeshard.models.gptoss import GptOssForCausalLM, get_preset_config

OPTIONS = LoraOptions(rank=4, alpha=8, target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


def test_expert_adapters_equal_the_merged_weights_and_only_they_train():
    torch.manual_seed(0)
    base = GptOssForCausalLM(get_preset_config("tiny"))
    with torch.no_grad():  # every parameter random: the experts' biases non-zero
        for p in base.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    adapted = copy.deepcopy(base)
    adapters = apply_lora(adapted, OPTIONS, seed=1)
    with torch.no_grad():  # B starts at zero (the adapted model equals its base): give it values
        for name, p in adapted.named_parameters():
            if name.endswith("_lora_B"):
                p.copy_(torch.randn_like(p) * 0.2)
    with torch.no_grad():
        unmerged = base(torch.zeros(1, 1, dtype=torch.long)).logits
    merged = merged_weights(adapters, base.state_dict(), adapters.state_dict(adapted))
    assert len(merged) == 2 * base.config.num_hidden_layers
    base.load_state_dict(merged, strict=False)
    ids = torch.randint(0, base.config.vocab_size, (2, 12))
    out = adapted(ids, labels=ids)
    with torch.no_grad():
        want = base(ids).logits
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
    # the adapters move the output (so the equality above is not the base's own)
    assert not torch.allclose(adapted(torch.zeros(1, 1, dtype=torch.long)).logits, unmerged, atol=1e-3)
    out.loss.backward()
    trained = {n for n, p in adapted.named_parameters() if p.grad is not None}
    assert trained == {n for n, p in adapted.named_parameters() if "_lora_" in n}, trained
    assert all(adapted.get_parameter(n).grad.abs().sum() > 0 for n in trained)
