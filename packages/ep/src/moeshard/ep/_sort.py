"""Sorting routed copies by expert, and the inverse of a permutation: the pieces both the permutations
(:mod:`moeshard.ep._permute`) and the kernels' route (:mod:`moeshard.ep._kernels`) build on.

# T tokens, K top-k, E experts, N = T*K routed copies (copy t*K+k is token t's k-th)
"""

from __future__ import annotations

import torch

__all__ = ["inverse_permutation", "narrow_keys", "sort_by_expert"]


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the T*K routed copies by expert, stably (ties keep token order).

    Returns:
        ``order_N``: flat copy indices (``t * K + k``) in expert order; the copy's token is ``order_N // K``.
        ``counts_E``: copies per expert (int64, on the ids' device), computed without a host sync.
    """
    ids_N = topk_ids_TK.reshape(-1)
    sorted_ids_N, order_N = torch.sort(narrow_keys(ids_N, num_experts), stable=True)
    # searchsorted gives each expert's first position in the sorted ids; bincount would sync on CUDA.
    bounds = torch.arange(num_experts + 1, device=ids_N.device, dtype=sorted_ids_N.dtype)
    counts_E = torch.diff(torch.searchsorted(sorted_ids_N, bounds)).to(torch.int64)
    return order_N, counts_E


def narrow_keys(keys_N: torch.Tensor, bound: int) -> torch.Tensor:
    """``keys_N`` (integers in ``[0, bound)``) in the narrowest integer dtype that also holds ``bound`` itself.

    A stable sort's order depends only on the key values, so it is the same; but CUDA's radix sort makes one pass
    per byte of the key dtype, so uint8 keys (up to 255 experts) take one pass where int64 takes eight."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if bound <= torch.iinfo(dtype).max:
            return keys_N if keys_N.dtype == dtype else keys_N.to(dtype)
    return keys_N


def inverse_permutation(perm_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``a[perm][inv] == a``."""
    inv_N = torch.empty_like(perm_N)
    inv_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device, dtype=perm_N.dtype)
    return inv_N
