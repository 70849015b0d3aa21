"""``backward_elements`` against a census of what the expert pass allocates in backward (CPU, bf16, grouped_mm): the
largest set of routed-copy rows alive at once beyond the tensors its forward saved is what the dispatcher reports to
a planner, with and without low-rank deltas on the expert weights."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moeshard.ep import LowRankDelta, backward_elements
from moeshard.ep._mlp import grouped_expert_mlp


class _RowCensus(TorchDispatchMode):
    """The most bytes alive at once of the compute-dtype tensors of ``rows`` rows allocated while it is entered."""

    def __init__(self, rows: int, dtype: torch.dtype):
        super().__init__()
        self.rows, self.dtype, self.live, self.peak = rows, dtype, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.dim() == 2 and t.shape[0] == self.rows:
                s = t.untyped_storage()
                self.live.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("lowrank", [False, True], ids=["base", "deltas"])
def test_backward_elements_is_the_expert_pass_working_set(lowrank):
    torch.manual_seed(0)
    E, D, F, N, r, dt = 4, 64, 48, 256, 8, torch.bfloat16
    x = torch.randn(N, D, dtype=dt, requires_grad=True)
    s = torch.rand(N, requires_grad=True)
    w1 = torch.randn(E, 2 * F, D, dtype=dt, requires_grad=not lowrank) / D**0.5
    w2 = torch.randn(E, D, F, dtype=dt, requires_grad=not lowrank) / F**0.5
    counts = torch.tensor([N // E] * E)
    deltas = (None, None)
    if lowrank:  # adapters train, the base is frozen (no weight gradient is formed)
        deltas = tuple(
            LowRankDelta(
                torch.randn(E, r, i, dtype=dt, requires_grad=True),
                torch.randn(E, o, r, dtype=dt, requires_grad=True),
                2.0,
            )
            for o, i in ((2 * F, D), (D, F))
        )
    y = grouped_expert_mlp(x, counts, w1, w2, gemm="grouped_mm", row_weights=s, deltas=deltas)
    census = _RowCensus(N, dt)
    with census:
        grad = torch.randn(N, D, dtype=dt)  # the combine's backward hands the pass this
        y.backward(grad)
    assert census.peak == 2 * backward_elements("overlapped", 1, N, D, F, lowrank=lowrank)
