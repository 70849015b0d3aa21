"""Counting routed copies per expert in float32 lanes: shared by the expert load (:mod:`._expert_load`), the
balancing losses and the Triton top-k count kernel (:mod:`._topk_triton`), which lays its partial sums out the same
way."""

from __future__ import annotations

import torch

__all__ = ["COUNT_LANES", "weighted_counts"]


COUNT_LANES = 64
"""Lanes of :func:`weighted_counts`: each bin is counted in this many partial sums, so that a million float atomic
adds on CUDA land on ``64 x bins`` addresses instead of ``bins`` (with 128 experts the atomics' contention on 128
addresses was most of the counting's time in a trace)."""


def weighted_counts(index_N: torch.Tensor, weight_N: torch.Tensor, bins: int, lanes: int | None = None) -> torch.Tensor:
    """``zeros(bins).scatter_add_(0, index_N, weight_N)`` in float32, the partial sums spread over ``lanes``
    (element ``n`` in lane ``n % lanes``) and the lanes summed; ``lanes=None``: :data:`COUNT_LANES` on CUDA where
    there are more elements than lanes x bins, else one (the plain scatter). Weights that are whole numbers (0 and
    1: counts, padding masks) give exactly the plain scatter's sums, as long as every sum stays below 2**24 (float32
    integers are exact there). No host sync."""
    if lanes is None:
        lanes = COUNT_LANES if index_N.is_cuda and index_N.numel() > COUNT_LANES * bins else 1
    if lanes == 1:
        return torch.zeros(bins, dtype=torch.float32, device=index_N.device).scatter_add_(0, index_N, weight_N)
    lane_N = torch.arange(index_N.numel(), device=index_N.device) % lanes
    partial = torch.zeros(lanes * bins, dtype=torch.float32, device=index_N.device)
    partial.scatter_add_(0, index_N + lane_N * bins, weight_N)
    return partial.view(lanes, bins).sum(0)
