"""The expert MLP under autograd: :func:`grouped_expert_mlp` checks its arguments and runs one
:class:`~moeshard.ep._expert_pass.ExpertPass` (each local expert's gated MLP on its rows,
``down_e(act(gate_e x) * up_e x)``, with its hand-written backward) inside an autograd Function.

# N rows grouped by local expert, D hidden, E local experts, F expert width

The GEMM backends, the routing weights applied in the pass and the expert biases are the pass's
(:mod:`moeshard.ep._expert_pass`); the low-rank deltas (adapters) are :mod:`moeshard.ep._lowrank`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeshard.ep._expert_pass import NO_BIASES, ExpertPass
from moeshard.ep._kernels import Activation, activation_fn, kernels_for, resolve_gemm
from moeshard.ep._lowrank import NO_DELTAS, LowRankDelta, _deltas, delta_inputs
from moeshard.ep._options import RECOMPUTES
from moeshard.ep._weight_grads import WeightGradTarget, weight_grad_buffers

__all__ = ["check_biases", "grouped_expert_mlp"]


class _ExpertMLP(torch.autograd.Function):
    """:class:`ExpertPass` under autograd."""

    @staticmethod
    def forward(  # noqa: D102
        ctx, x_ND, s_N, w_gate_up, w_down, run: ExpertPass, target: WeightGradTarget | None, output: bool,
        b1, b2, scalings, A1, B1, A2, B2,
    ):  # fmt: skip
        deltas = _deltas(scalings, A1, B1, A2, B2)
        y_ND, saved = run.forward(x_ND, w_gate_up, w_down, s_N, output, deltas, (b1, b2))
        ctx.run, ctx.target, ctx.scalings = run, target, scalings
        ctx.save_for_backward(w_gate_up, w_down, b1, b2, A1, B1, A2, B2, *saved)
        return y_ND if output else x_ND.new_empty((x_ND.shape[0], w_down.shape[1]))

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: D102
        w_gate_up, w_down, b1, b2, A1, B1, A2, B2, *saved = ctx.saved_tensors
        need_x, need_s, need_w1, need_w2 = ctx.needs_input_grad[:4]
        into = weight_grad_buffers(ctx.target, w_gate_up, w_down, need_w1, need_w2, factors=True)
        deltas = _deltas(ctx.scalings, A1, B1, A2, B2)
        gx, gw1, gw2, gs, gb, (g1, g2) = ctx.run.backward(
            grad_ND, saved, w_gate_up, w_down, need_x, need_w1 or need_w2, into, deltas, (b1, b2)
        )
        gb = tuple(g if need else None for g, need in zip(gb, ctx.needs_input_grad[7:9]))
        gd = (*(g1 or (None, None)), *(g2 or (None, None)))
        gd = tuple(g if need else None for g, need in zip(gd, ctx.needs_input_grad[10:]))
        return (gx, gs if need_s else None, gw1 if need_w1 else None, gw2 if need_w2 else None, None, None, None,
                *gb, None, *gd)  # fmt: skip


def grouped_expert_mlp(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor | Sequence[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    host_counts: Sequence[int] | None = None,
    activation: Activation = "silu",
    gemm: str = "auto",
    kernels: str = "eager",
    recompute: str = "none",
    weight_grads: WeightGradTarget | None = None,
    row_weights: torch.Tensor | None = None,
    output: bool = True,
    deltas: tuple[LowRankDelta | None, LowRankDelta | None] = NO_DELTAS,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = NO_BIASES,
) -> torch.Tensor:
    """Run each local expert's gated MLP on its rows: ``down_e(act(gate_e x) * up_e x)`` (SwiGLU with silu).

    Args:
        x_ND: token rows grouped by local expert (expert 0's rows first).
        counts_E: rows per local expert, a 1-D integer tensor on x's device or a sequence of ints (then copied
            to the device for grouped_mm); must sum to N.
        w_gate_up: ``[E, 2F, D]``, gate rows first, then up.
        w_down: ``[E, D, F]``.
        host_counts: the same counts as host ints when the caller already has them: spares the loop backend
            its one ``.tolist()`` (a device→host sync).
        activation: ``"silu"`` (SwiGLU), ``"gelu"``, ``"gelu_tanh"`` or a spec (``ClampedSwiGLU``).
        gemm: ``"grouped_mm"``, ``"loop"`` or ``"auto"`` (see :class:`~moeshard.ep.EPOptions`).
        kernels: the kernel tier of the gated activation, ``"eager"``, ``"compiled"`` or ``"triton"``.
        recompute: ``"none"``, ``"activation"`` or ``"mlp"``: what backward recomputes instead of keeping it
            (see :class:`~moeshard.ep.EPOptions`).
        weight_grads: where backward adds the weight gradients instead of returning them (see
            :data:`WeightGradTarget`); None: returned to autograd.
        row_weights: ``[N]``, each row's routing weight, or None. With them the rows come out weighted,
            ``y_n = w_n · down(act(gate x_n) · up x_n)`` (the weight applied, in float32, to the gated activation
            before the down projection), and the weights get their gradient.
        output: False: the down projection is not run and the result's values are undefined (the recompute of a
            checkpointed region that discards its outputs, see ``moeshard.ep.recompute_contexts``); what backward
            saves and computes is the same.
        deltas: a :class:`LowRankDelta` or None per weight (gate/up, down): adds ``s · B_e A_e`` to expert
            ``e``'s weight, applied by rank-``r`` grouped GEMMs beside the base ones; ``A`` and ``B`` get gradients.
        biases: ``(b_gate_up [E, 2F] | None, b_down [E, D] | None)``, the experts' biases (see the module
            docstring); they get their gradients.

    Returns:
        ``y_ND`` in the rows' order. Every expert's weights get a gradient, zeros for an expert without rows.
    """
    activation_fn(activation)
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTES}")
    E = w_gate_up.shape[0]
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_down.shape[0] != E:
        raise ValueError(
            f"expert weights must be w_gate_up [E, 2F, D] and w_down [E, D, F] with the same E, got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}"
        )
    if w_gate_up.shape[1] != 2 * w_down.shape[2] or w_gate_up.shape[2] != w_down.shape[1]:
        raise ValueError(
            f"expert weights disagree: w_gate_up {tuple(w_gate_up.shape)} needs [E, 2F, D] and w_down "
            f"{tuple(w_down.shape)} needs [E, D, F]"
        )
    n_counts = counts_E.numel() if isinstance(counts_E, torch.Tensor) else len(counts_E)
    if n_counts != E:
        raise ValueError(f"counts_E has {n_counts} entries for {E} local experts")
    tier = kernels_for(kernels)
    backend = resolve_gemm(gemm, x_ND, w_gate_up)
    if backend == "grouped_mm":
        if not isinstance(counts_E, torch.Tensor):
            counts_E = torch.tensor(list(counts_E), dtype=torch.int64, device=x_ND.device)
        run = ExpertPass(counts_E.to(x_ND.device), host_counts, activation, backend, tier, recompute=recompute)
    else:
        counts = counts_E if host_counts is None else host_counts
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # host sync: the loop needs the row counts on the host
        if sum(counts) != x_ND.shape[0]:
            raise ValueError(f"counts_E sums to {sum(counts)} but x has {x_ND.shape[0]} rows")
        counts_t = counts_E if isinstance(counts_E, torch.Tensor) else None
        run = ExpertPass(counts_t, counts, activation, backend, tier, recompute=recompute)
    if row_weights is not None and row_weights.shape != (x_ND.shape[0],):
        raise ValueError(f"row_weights must be [N] = [{x_ND.shape[0]}], one per row, got {tuple(row_weights.shape)}")
    biases = tuple(biases)
    check_biases(biases, w_gate_up, w_down)
    lowrank = delta_inputs(deltas, (w_gate_up, w_down), x_ND.dtype)
    return _ExpertMLP.apply(x_ND, row_weights, w_gate_up, w_down, run, weight_grads, output, *biases, *lowrank)


def check_biases(biases, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """ValueError unless ``biases`` is a pair (gate/up, down) of tensors or None that fit the weights."""
    if len(biases) != 2:
        raise ValueError(f"biases must be a pair (b_gate_up, b_down) of tensors or None, got {len(biases)} entries")
    b_gu, b_d = biases
    want = ((w_gate_up.shape[0], w_gate_up.shape[1]), (w_down.shape[0], w_down.shape[1]))
    for name, b, shape in (("gate_up", b_gu, want[0]), ("down", b_d, want[1])):
        if b is not None and tuple(b.shape) != shape:
            raise ValueError(
                f"the {name} bias must be [E, {'2F' if name == 'gate_up' else 'D'}] = {list(shape)} like its "
                f"weight, got {list(b.shape)}"
            )
