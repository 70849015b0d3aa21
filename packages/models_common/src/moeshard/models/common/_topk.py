"""The routers' top-k: ``torch.topk``'s selection, on CUDA by a Triton kernel (:func:`row_topk`).

The kernel (``moeshard.models.common._topk_triton``, imported only for CUDA tensors) is called through the custom op
``moeshard::topk_ids``, opaque to ``torch.compile`` (the routers run inside the compiled attention half); the values
are the scores gathered at the ids, so autograd differentiates them as ``torch.topk``'s (a scatter into the scores).
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["KERNEL_MAX_EXPERTS", "KERNEL_MAX_TOP_K", "row_topk"]

KERNEL_MAX_EXPERTS = 1024
"""The most experts the Triton top-k kernels take (a block of rows lives in registers)."""
KERNEL_MAX_TOP_K = 32
"""The largest ``k`` they take (one unrolled round per selected expert)."""
_TRITON = importlib.util.find_spec("triton") is not None  # decided once, outside any compiled code


@torch.library.custom_op("moeshard::topk_ids", mutates_args=())
def _topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    from moeshard.models.common._topk_triton import topk_ids

    return topk_ids(scores, k)


@_topk_ids.register_fake
def _(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty((*scores.shape[:-1], k), dtype=torch.int64)


def row_topk(scores_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores_TE, k, dim=-1)``: values and int64 ids, sorted by value. For a CUDA ``[T, E]`` tensor
    (with triton, at most :data:`KERNEL_MAX_EXPERTS` experts and ``k`` up to :data:`KERNEL_MAX_TOP_K`) the ids come
    from one Triton kernel: the same selection as ``torch.topk`` on CUDA, equal values listed by index (where
    ``torch.topk`` has an order of its own among them), in one launch instead of a radix select and a sort
    (0.12 ms per layer of 16,384 tokens and 128 experts on one H200). Elsewhere ``torch.topk`` itself."""
    e = scores_TE.shape[-1]
    if (
        scores_TE.is_cuda
        and _TRITON
        and scores_TE.dim() == 2
        and e <= KERNEL_MAX_EXPERTS
        and k <= min(e, KERNEL_MAX_TOP_K)
    ):
        ids_TK = _topk_ids(scores_TE.detach(), int(k))
        return scores_TE.gather(-1, ids_TK), ids_TK
    return torch.topk(scores_TE, k, dim=-1)
