"""Activation checkpointing replays each EP layer's exchange sizes in the recompute: one host sync per MoE layer per
forward with or without checkpointing (a local dispatcher that reads its sizes like the EP strategies stands in for
EP here; the EP strategies themselves are tested over gloo in moeshard-ep)."""

from __future__ import annotations

import torch

from moeshard.ep import LocalDispatch
from moeshard.models.common import Experts, apply_activation_checkpointing
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM


class _SizedLocalDispatch(LocalDispatch):
    """LocalDispatch that first reads its sizes on the host through ``host_sizes``, as the EP strategies do, and
    counts the reads that synchronise (``before_host_sync`` runs right before each)."""

    synced = 0

    def before_host_sync(self) -> None:  # noqa: D102
        type(self).synced += 1

    def run_experts(self, x_sorted_ND, w_sorted_N, counts_E, *rest):  # noqa: D102
        self.host_sizes(counts_E, counts_E)
        return super().run_experts(x_sorted_ND, w_sorted_N, counts_E, *rest)


def test_checkpointed_layers_read_their_exchange_sizes_once():
    config = ToyConfig(dense_layers=[])
    torch.manual_seed(0)
    model = ToyForCausalLM(config)
    model.init_weights()
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        experts.dispatch = _SizedLocalDispatch(config.pool)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    syncs, grads = [], []
    for checkpointing in (False, True):
        if checkpointing:
            apply_activation_checkpointing(model)
        model.zero_grad(set_to_none=True)
        _SizedLocalDispatch.synced = 0
        model(ids, labels=ids).loss.backward()
        syncs.append(_SizedLocalDispatch.synced)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert syncs == [3, 3]  # one per MoE layer, the recompute replays
    assert all(torch.equal(a, b) for a, b in zip(*grads))
