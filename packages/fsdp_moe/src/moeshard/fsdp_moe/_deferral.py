"""When the local experts keep a step's weight gradients as factors: the option and its memory budget.

Where ``ep_fsdp`` has one rank, the experts' weight gradients of a step's micro-batches can be kept unformed (as
``moeshard.ep.WeightGradFactors``) and formed once, in the step's last backward (``_local_experts``). Keeping them
holds memory: each micro-batch's factors hold ``moeshard.ep.kept_factor_elements`` elements (what the EP dispatcher
reports), all but the last micro-batch's are kept, against the gradients' own elements. This module owns that
arithmetic and the rule that turns it into a budget; the optimizer (:class:`LocalExpertAdamW`)
takes :class:`ExpertGradOptions` and applies them at every step by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_BUDGET", "EXPERT_WEIGHT_GRADS", "ExpertGradOptions", "expert_grad_budget", "kept_factor_ratio"]

DEFAULT_BUDGET = 1.1
"""Kept factors may hold up to this times the bytes of the gradients they stand for, per expert module (at EP 1
with 128 experts, micro-batches of 4,096 tokens, 3 micro-batches' factors hold 1.04x the gradients)."""

EXPERT_WEIGHT_GRADS = ("auto", "every_micro_batch", "last_micro_batch")
"""When the local experts' weight gradients are formed: at every micro-batch, once in the step's last backward
(from factors kept meanwhile, however much they hold), or ``auto``: the latter where the kept factors fit the
budget, else the former."""


@dataclass(frozen=True)
class ExpertGradOptions:
    """How the weight gradients of the experts kept out of FSDP accumulate over a step's micro-batches.

    Given to :func:`moeshard.fsdp_moe.build_optimizer` (or :class:`LocalExpertAdamW`): from
    then on each ``zero_grad`` starts a step of ``micro_batches`` backwards, the first ``micro_batches - 1`` of
    which keep the experts' weight gradients as factors and the last forms them all, each written once over every
    micro-batch's rows; the trainer calls nothing else. A step with fewer backwards leaves factors kept, which the
    optimizer forms when it reads the gradients; later backwards add into the formed gradients as usual.

    Attributes:
        micro_batches: backwards per optimizer step (gradient accumulation); 1: nothing is kept.
        mode: one of :data:`EXPERT_WEIGHT_GRADS`.
        budget: for ``auto``, the most the kept factors may hold, as a multiple of the gradients' bytes (checked
            up front from the dispatcher's report, and per expert module while keeping).
    """

    micro_batches: int = 1
    mode: str = "auto"
    budget: float = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"ExpertGradOptions: micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.mode not in EXPERT_WEIGHT_GRADS:
            raise ValueError(
                f"ExpertGradOptions: mode must be one of {', '.join(EXPERT_WEIGHT_GRADS)}, got {self.mode!r}"
            )
        if not self.budget >= 0:
            raise ValueError(f"ExpertGradOptions: budget must be >= 0, got {self.budget}")


def kept_factor_ratio(kept_elements: float, micro_batches: int, grad_elements: int) -> float:
    """What a step's kept factors hold over the gradients they stand for: all but the last micro-batch's,
    ``(micro_batches - 1) · kept_elements / grad_elements``.

    Args:
        kept_elements: one micro-batch's factors (``moeshard.ep.kept_factor_elements``).
        micro_batches: backwards per step.
        grad_elements: the local experts' gradient elements (per MoE layer: ``local experts · 3DF``).
    """
    return (micro_batches - 1) * kept_elements / max(1, grad_elements)


def expert_grad_budget(mode: str, kept_ratio: float | None = None, budget: float = DEFAULT_BUDGET) -> float | None:
    """The budget a step keeps factors within, by ``mode`` (:data:`EXPERT_WEIGHT_GRADS`): None (nothing kept:
    ``every_micro_batch``), unbounded (``last_micro_batch``) or, for ``auto``, ``budget`` where ``kept_ratio``
    (:func:`kept_factor_ratio`; None: not known) is within it, else None: a step whose factors do not fit forms the
    gradients at every micro-batch instead of keeping some and forming them part-way."""
    if mode not in EXPERT_WEIGHT_GRADS:
        raise ValueError(f"expert weight gradients: mode must be one of {', '.join(EXPERT_WEIGHT_GRADS)}, got {mode!r}")
    if mode == "every_micro_batch":
        return None
    if mode == "last_micro_batch":
        return float("inf")
    return budget if kept_ratio is None or kept_ratio <= budget else None
