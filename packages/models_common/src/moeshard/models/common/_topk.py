"""The routers' top-k: ``torch.topk``'s selection, on CUDA by a Triton kernel where the kernel tier asks for it
(:func:`row_topk`).

The kernel (the custom op ``moeshard::topk_ids`` of ``moeshard.models.common._topk_triton``, which imports
triton) is handed in by the caller: ``parallelize`` gives it to the routers with the ``"triton"`` kernel tier on a
machine with CUDA, as it gives the head its loss kernel. Inside the compiled attention half the op is opaque to
``torch.compile``, like the kept ops; the values are the scores gathered at the ids, so autograd differentiates
them as ``torch.topk``'s (a scatter into the scores).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["KERNEL_MAX_EXPERTS", "KERNEL_MAX_TOP_K", "TopkIds", "kernel_takes", "row_topk"]

KERNEL_MAX_EXPERTS = 1024
"""The most experts the Triton top-k kernels take (a block of rows lives in registers)."""
KERNEL_MAX_TOP_K = 32
"""The largest ``k`` they take (one unrolled round per selected expert)."""

TopkIds = Callable[[torch.Tensor, int], torch.Tensor]
"""``topk_ids(scores_TE, k) -> ids_TK``: the kernel's selection (``moeshard.models.common._topk_triton``'s
``topk_ids_op``, or its ``topk_ids`` outside compiled code)."""


def kernel_takes(num_experts: int, k: int) -> bool:
    """Whether the Triton top-k kernels take rows of ``num_experts`` scores and ``k`` selected: at most
    :data:`KERNEL_MAX_EXPERTS` experts and ``1 <= k <= min(num_experts, KERNEL_MAX_TOP_K)``."""
    return num_experts <= KERNEL_MAX_EXPERTS and 1 <= k <= min(num_experts, KERNEL_MAX_TOP_K)


def row_topk(scores_TE: torch.Tensor, k: int, kernel: TopkIds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores_TE, k, dim=-1)``: values and int64 ids, sorted by value. With ``kernel`` and a CUDA
    ``[T, E]`` tensor (at most :data:`KERNEL_MAX_EXPERTS` experts, ``k`` up to :data:`KERNEL_MAX_TOP_K`) the ids come
    from the kernel: the same selection as ``torch.topk`` on CUDA, equal values listed by index (where ``torch.topk``
    has an order of its own among them), in one launch instead of a radix select and a sort. Elsewhere
    ``torch.topk`` itself."""
    if kernel is not None and scores_TE.is_cuda and scores_TE.dim() == 2 and kernel_takes(scores_TE.shape[-1], k):
        ids_TK = kernel(scores_TE.detach(), int(k))
        return scores_TE.gather(-1, ids_TK), ids_TK
    return torch.topk(scores_TE, k, dim=-1)
