"""``ExpertGradOptions`` and the budget arithmetic of the local experts' kept weight-gradient factors (the gloo
checks that the optimizer defers by itself are in ``test_fused_update.py``)."""

from __future__ import annotations

import pytest

from moeshard.fsdp_moe import ExpertGradOptions, expert_grad_budget, kept_factor_ratio
from moeshard.fsdp_moe._deferral import DEFAULT_BUDGET, EXPERT_WEIGHT_GRADS


def test_budget_by_mode_and_ratio():
    """never, always, or (``auto``) the budget where the step's factors fit it, never where they do not."""
    assert EXPERT_WEIGHT_GRADS == ("auto", "every_micro_batch", "last_micro_batch")
    assert expert_grad_budget("every_micro_batch") is None and expert_grad_budget("every_micro_batch", 0.5) is None
    assert expert_grad_budget("last_micro_batch") == expert_grad_budget("last_micro_batch", 3.0) == float("inf")
    assert expert_grad_budget("auto") == expert_grad_budget("auto", 1.04) == DEFAULT_BUDGET == 1.1
    assert expert_grad_budget("auto", 1.2) is None
    assert expert_grad_budget("auto", 1.2, budget=1.5) == 1.5 and expert_grad_budget("auto", 0.1, budget=0.0) is None
    with pytest.raises(ValueError, match="mode must be one of"):
        expert_grad_budget("never")


def test_kept_factor_ratio():
    """All but the last micro-batch's factors over the gradients: 30B-A3B at EP 1, 4 x 4,096 tokens: 1.04x."""
    per_micro_batch = 4096 * 8 * (2 * 2048 + 3 * 768)  # routed copies x (2D + 3F)
    gradient = 128 * 3 * 2048 * 768
    assert kept_factor_ratio(per_micro_batch, 4, gradient) == pytest.approx(3 * per_micro_batch / gradient)
    assert kept_factor_ratio(per_micro_batch, 4, gradient) == pytest.approx(1.04, abs=0.005)
    assert kept_factor_ratio(per_micro_batch, 1, gradient) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batches": 0}, "micro_batches must be an int >= 1"),
        ({"micro_batches": 2.0}, "micro_batches must be an int >= 1"),
        ({"mode": "never"}, "mode must be one of auto, every_micro_batch, last_micro_batch"),
        ({"budget": -1.0}, "budget must be >= 0"),
    ],
)
def test_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertGradOptions(**kwargs)
    assert ExpertGradOptions() == ExpertGradOptions(micro_batches=1, mode="auto", budget=DEFAULT_BUDGET)
