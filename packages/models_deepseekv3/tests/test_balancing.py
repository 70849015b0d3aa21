"""Balancing through the shared object on DeepSeek-V3's routers: the expert load is the routers' own group-limited,
bias-shifted selection, and the aux-loss-free update moves ``e_score_correction_bias`` by DeepSeek-V3's rule."""

from __future__ import annotations

import torch

from moeshard.models.common import Balancing, BalancingOptions, expert_counts, routers
from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM


def test_counts_are_the_routers_selection_and_the_bias_moves_by_the_rule(hf_dir, batch):
    ids, mask, labels = batch
    model = DeepseekV3ForCausalLM.from_pretrained(hf_dir)
    rs = routers(model)
    chosen = []
    hooks = [r.register_forward_hook(lambda m, i, out: chosen.append(out[2])) for r in rs]
    out = model(ids, labels=labels, attention_mask=mask, output_router_logits=True)
    for h in hooks:
        h.remove()
    counts = expert_counts(out.router_logits, model.config.num_experts_per_tok, attention_mask_BS=mask, routers=rs)
    keep = mask.reshape(-1).bool()
    for layer, ids_TK in enumerate(chosen):  # what the routers selected, padding left out
        want = torch.bincount(ids_TK[keep].flatten(), minlength=model.num_experts).float()
        assert torch.equal(counts[layer], want), layer
    assert all(torch.equal(a, b) for a, b in zip(out.router_ids, chosen, strict=True))  # handed on as routed
    handed = expert_counts(out.router_logits, 2, attention_mask_BS=mask, router_ids=out.router_ids)
    assert torch.equal(handed, counts)
    # softmax top-k of the logits (Qwen3-MoE's rule) is another selection: the routers' own is what counts
    assert not torch.equal(expert_counts(out.router_logits, 2, attention_mask_BS=mask), counts)

    balancing = Balancing(model, BalancingOptions(router_bias_rate=0.01), device="cpu")
    before = [r.e_score_correction_bias.clone() for r in rs]
    balancing.start_step(1)
    balancing.micro_batch_loss(out, mask)
    load = balancing.end_step().expert_load
    balancing.after_optimizer_step()
    assert torch.equal(load, counts)
    for r, b, load_E in zip(rs, before, load):  # bias += γ · sign(mean load - load)
        torch.testing.assert_close(r.e_score_correction_bias, b + 0.01 * torch.sign(load_E.mean() - load_E))
