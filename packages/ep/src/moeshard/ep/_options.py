"""The options of expert parallelism: which dispatch strategy, kernel tier and expert GEMM a model's MoE layers use.

Passed where they are used (``apply_ep(model, plan, ep_mesh, options)``, ``routed_experts(..., options=...)``,
a dispatcher's constructor) and kept by each dispatcher, so two models in one process may use different options.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

__all__ = ["EPOptions"]

DISPATCHES = ("overlapped", "all_to_all")
KERNEL_TIERS = ("eager", "compiled", "triton")
GEMMS = ("auto", "grouped_mm", "loop")
RECOMPUTES = ("none", "activation", "mlp")


@dataclass(frozen=True)
class EPOptions:
    """How the routed experts of every MoE layer run; all choices give the same results (to float rounding).

    Each field is named, limited (its ``Literal`` type and :meth:`__post_init__`, whose ``ValueError`` names it as
    ``EPOptions.<field>``) and explained (its ``help`` metadata, one line for front ends to print) in one place.
    """

    dispatch: Literal[DISPATCHES] = field(
        default="overlapped",
        metadata={
            "help": 'the strategy for EP size > 1 (EP size 1 always runs locally): `"overlapped"` (every routed '
            "copy bound for another rank travels by point-to-point ops while the rank's own copies go through their "
            'experts) or `"all_to_all"` (one plain `all_to_all_single` each way, no overlap: the readable '
            "reference)."
        },
    )
    kernels: Literal[KERNEL_TIERS] = field(
        default="eager",
        metadata={
            "help": 'the pointwise and gather kernels around the expert GEMMs: `"eager"` (torch ops), '
            '`"compiled"` (`torch.compile`d, rows dynamic) or `"triton"` (the kernels of `moeshard.ep._triton` '
            "on CUDA tensors, the compiled ones for everything else)."
        },
    )
    gemm: Literal[GEMMS] = field(
        default="auto",
        metadata={
            "help": 'the expert GEMM: `"grouped_mm"` (one `torch.nn.functional.grouped_mm` per weight), '
            '`"loop"` (two matmuls per expert), `"auto"` (grouped_mm on CUDA for bf16/fp16 at compute '
            "capability >= 9.0, the loop elsewhere)."
        },
    )
    sm_carveout: int = field(
        default=32,
        metadata={
            "help": "SMs the expert GEMMs leave free for the communication kernel while they overlap an exchange "
            '(`"overlapped"` on CUDA only); 0 turns the carve-out off.'
        },
    )
    recompute: Literal[RECOMPUTES] = field(
        default="none",
        metadata={
            "help": "what the expert MLP recomputes in backward instead of keeping it from forward (selective "
            'activation checkpointing inside the experts; results are bit-identical): `"none"` keeps the expert '
            "input, the gate/up GEMM output and the gated activation (`D + 3F` elements per routed copy; the outputs "
            'are never kept); `"activation"` keeps the first two and recomputes the gated activation inside the '
            "activation's backward kernel (frees `F` elements per routed copy, for an extra write of them); "
            '`"mlp"` keeps only the expert input and recomputes the gate/up GEMM and the activation (one more '
            "grouped GEMM per layer in backward; frees `3F` elements per routed copy)."
        },
    )

    def __post_init__(self) -> None:
        choices = (("dispatch", DISPATCHES), ("kernels", KERNEL_TIERS), ("gemm", GEMMS), ("recompute", RECOMPUTES))
        for name, allowed in choices:
            value = getattr(self, name)
            if value not in allowed:
                hint = " (the de-duplicated 'tokens' dispatch was removed in 0.2.0)" if value == "tokens" else ""
                raise ValueError(f"EPOptions.{name}={value!r} is not one of {allowed}{hint}")
        if not isinstance(self.sm_carveout, int) or isinstance(self.sm_carveout, bool) or self.sm_carveout < 0:
            raise ValueError(
                f"EPOptions.sm_carveout={self.sm_carveout!r} is not allowed: an int >= 0 (SMs left to the exchange "
                "while a GEMM overlaps it; 0 = off)"
            )

    def describe(self) -> str:
        """One line, e.g. ``dispatch=overlapped kernels=triton gemm=auto sm_carveout=32 recompute=none``."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
