"""``weighted_counts``: the lane-spread scatter gives the plain scatter's counts exactly (0/1 weights), and the
callers that count with it (the load-balancing loss, ``expert_counts``) keep their values."""

from __future__ import annotations

import torch

from moeshard.models.common._expert_load import weighted_counts


def test_lanes_give_the_plain_scatters_counts():
    g = torch.Generator().manual_seed(0)
    for bins, n in ((128, 40_000), (1024, 9_000), (7, 5)):
        index = torch.randint(0, bins, (n,), generator=g)
        index[: n // 3] = bins - 1  # a crowded bin
        weight = (torch.rand(n, generator=g) > 0.2).float()  # a padding mask's zeros and ones
        plain = torch.zeros(bins).scatter_add_(0, index, weight)
        for lanes in (1, 3, 64):
            assert torch.equal(weighted_counts(index, weight, bins, lanes=lanes), plain), (bins, lanes)
        assert torch.equal(weighted_counts(index, weight, bins), plain)  # one lane on the CPU
