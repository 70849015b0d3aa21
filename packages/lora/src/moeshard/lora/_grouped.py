"""LoRA on fused expert tensors, applied to token rows already grouped by expert (the grouped-GEMM layout).

# N rows grouped by local expert, E local experts, K in features, M out features, r rank

Expert ``e``'s adapter is ``A_e [r, K]``, ``B_e [M, r]``; its rows get ``s · x A_eᵀ B_eᵀ`` added to the base GEMM's
output. Two backends, equal to float rounding, neither looping over experts in Python nor forming a weight per
token:

- ``"grouped_mm"``: two ``torch.nn.functional.grouped_mm`` calls with the rows' int32 cumulative offsets (no host
  sync) and a hand-written backward of four more (torch's own backward of ``grouped_mm`` needs a contiguous
  gradient, which a sum's expanded gradient is not). Needs 16-byte aligned strides: ``r``, ``K`` and ``M`` times
  the element size multiples of 16, and a dtype the kernel has (CPU: float32, bfloat16, float16; CUDA: bfloat16 or
  float16 at compute capability >= 9.0).
- ``"masked"``: one dense GEMM against every expert's ``A`` stacked (``[E·r, K]``, PEFT's own storage), the columns
  of other experts zeroed per row, then one dense GEMM against the stacked ``B``. ``E`` times the adapter's FLOPs,
  any dtype and shape: the fallback where grouped_mm cannot run.

``"auto"`` picks grouped_mm where it can run, masked elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["expert_lora_delta", "resolve_lora_gemm"]

GEMMS = ("auto", "grouped_mm", "masked")


def _aligned(x: torch.Tensor, *dims: int) -> bool:
    return all(d * x.element_size() % 16 == 0 for d in dims)


def resolve_lora_gemm(gemm: str, x_ND: torch.Tensor, rank: int, out_features: int) -> str:
    """The backend ``gemm`` means for rows ``x_ND`` (``"grouped_mm"`` or ``"masked"``), see the module docstring."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
    if gemm != "auto":
        return gemm
    if not _aligned(x_ND, rank, x_ND.shape[-1], out_features):
        return "masked"
    if x_ND.device.type == "cpu":
        return "grouped_mm" if x_ND.dtype in (torch.float32, torch.bfloat16, torch.float16) else "masked"
    if x_ND.device.type == "cuda" and x_ND.dtype in (torch.bfloat16, torch.float16):
        return "grouped_mm" if torch.cuda.get_device_capability(x_ND.device)[0] >= 9 else "masked"
    return "masked"


class _GroupedLora(torch.autograd.Function):
    """``s · x A_eᵀ B_eᵀ`` per group of rows, by grouped_mm both ways."""

    @staticmethod
    def forward(ctx, x_NK, A_ErK, B_EMr, offs, scaling):  # noqa: D102
        t_Nr = F.grouped_mm(x_NK, A_ErK.transpose(-2, -1), offs=offs)
        y_NM = F.grouped_mm(t_Nr, B_EMr.transpose(-2, -1), offs=offs)
        ctx.scaling = scaling
        ctx.save_for_backward(x_NK, t_Nr, A_ErK, B_EMr, offs)
        return y_NM * scaling

    @staticmethod
    def backward(ctx, g_NM):  # noqa: D102
        x_NK, t_Nr, A_ErK, B_EMr, offs = ctx.saved_tensors
        s = ctx.scaling
        g_NM = g_NM.contiguous()
        gt_Nr = (F.grouped_mm(g_NM, B_EMr, offs=offs) * s).contiguous()
        gx = gA = gB = None
        if ctx.needs_input_grad[2]:
            gB = F.grouped_mm(g_NM.transpose(0, 1), t_Nr, offs=offs) * s  # [E, M, r]; zeros for an expert without rows
        if ctx.needs_input_grad[0]:
            gx = F.grouped_mm(gt_Nr, A_ErK, offs=offs)
        if ctx.needs_input_grad[1]:
            gA = F.grouped_mm(gt_Nr.transpose(0, 1), x_NK, offs=offs)  # [E, r, K]
        return gx, gA, gB, None, None


def _masked(x_NK, counts_E, A_ErK, B_EMr, scaling):
    E, r, K = A_ErK.shape
    expert_N = torch.repeat_interleave(torch.arange(E, device=x_NK.device), counts_E, output_size=x_NK.shape[0])
    t_NC = x_NK @ A_ErK.reshape(E * r, K).transpose(0, 1)  # C = E·r columns, expert-major
    keep_NC = expert_N[:, None] == torch.arange(E, device=x_NK.device).repeat_interleave(r)[None, :]
    B_OC = B_EMr.permute(1, 0, 2).reshape(B_EMr.shape[1], E * r)
    return (t_NC * keep_NC) @ B_OC.transpose(0, 1) * scaling


def expert_lora_delta(
    x_NK: torch.Tensor,
    counts_E: torch.Tensor | Sequence[int],
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    gemm: str = "auto",
) -> torch.Tensor:
    """Each expert's LoRA output on its rows, ``s · x A_eᵀ B_eᵀ``, to add to the base grouped GEMM's output.

    Args:
        x_NK: rows grouped by local expert (expert 0's rows first), the base GEMM's input.
        counts_E: rows per local expert, an integer tensor on x's device or a sequence of ints; sums to N.
        lora_A: ``[E, r, K]`` (cast to x's dtype here; the gradient reaches the original, e.g. a float32 master).
        lora_B: ``[E, M, r]``.
        scaling: the adapter's scaling (``LoraOptions.scaling``).
        gemm: ``"grouped_mm"``, ``"masked"`` or ``"auto"`` (see the module docstring).

    Returns:
        ``[N, M]`` in x's dtype. ``lora_A`` and ``lora_B`` get gradients for every expert, zeros for one without rows.
    """
    if (
        lora_A.dim() != 3
        or lora_B.dim() != 3
        or lora_A.shape[0] != lora_B.shape[0]
        or lora_A.shape[1] != lora_B.shape[2]
    ):
        raise ValueError(
            f"expert adapters must be lora_A [E, r, K] and lora_B [E, M, r], got {tuple(lora_A.shape)} and "
            f"{tuple(lora_B.shape)}"
        )
    E, r, K = lora_A.shape
    if x_NK.dim() != 2 or x_NK.shape[1] != K:
        raise ValueError(f"rows must be [N, {K}] for lora_A {tuple(lora_A.shape)}, got {tuple(x_NK.shape)}")
    if not isinstance(counts_E, torch.Tensor):
        counts = list(counts_E)
        if len(counts) != E or sum(counts) != x_NK.shape[0]:
            raise ValueError(f"counts_E {counts} must have {E} entries summing to the {x_NK.shape[0]} rows")
        counts_E = torch.tensor(counts, dtype=torch.int64, device=x_NK.device)
    elif counts_E.numel() != E:
        raise ValueError(f"counts_E has {counts_E.numel()} entries for {E} local experts")
    A, B = lora_A.to(x_NK.dtype), lora_B.to(x_NK.dtype)
    if resolve_lora_gemm(gemm, x_NK, r, B.shape[1]) == "masked":
        return _masked(x_NK, counts_E.to(x_NK.device), A, B, scaling)
    offs = torch.cumsum(counts_E.to(x_NK.device), 0, dtype=torch.int32)
    return _GroupedLora.apply(x_NK.contiguous(), A.contiguous(), B.contiguous(), offs, float(scaling))
