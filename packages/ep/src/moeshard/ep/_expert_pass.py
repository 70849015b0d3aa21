"""The expert-MLP pass: each local expert's gated MLP on its rows, ``down_e(act(gate_e x) * up_e x)``, as a forward
that returns what its backward needs and a hand-written backward (:class:`ExpertPass`).

# N rows grouped by local expert, D hidden, E local experts, F expert width, X = 2F (gate rows, then up rows)

Every dispatch strategy runs it; :func:`moeshard.ep._mlp.grouped_expert_mlp` wraps it in an autograd Function for
callers that want autograd. Two GEMM backends that agree within dtype tolerance:

- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` with int32 cumulative row offsets; no host sync. The
  gated activation (both ways) comes from the kernel tier (:mod:`moeshard.ep._kernels`).
- ``"loop"``: one pair of matmuls per expert, with the eager gated activation; needs the per-expert counts on
  the host (one ``.tolist()`` unless the caller already has them) and runs on any device and dtype.

``"auto"`` picks ``grouped_mm`` on CUDA for bf16/fp16 on compute capability >= 9.0 (where it is fast and
tested), the loop elsewhere (on CPU, torch's grouped_mm needs 16-byte aligned strides and has no float64).

**Routing weights applied in the pass.** Given each row's routing weight (``row_weights``, float32), the pass
scales the gated activation by it before the down projection, ``y_n = down(w_n · act(gate x_n) · up x_n)``, and
backward returns the weights' gradient ``Σ_f grad_a · act(gate) · up`` from the activation's backward kernel: the
dispatchers' combine then only adds each token's copies, and nothing of the outputs is kept for that gradient.

**Expert biases** (optional, each independently): ``b_gate_up [E, X]`` added to the gate/up GEMM's rows and
``b_down [E, D]`` to the down projection's, scaled by the row's routing weight like the rest of its output,
``y_n = s_n · (down(act(gate x_n + b) · up ...) + b_down)``. Their gradients are each expert's row sums (an
``index_add`` over the rows' experts, no host sync) and go to autograd; without biases none of this runs.

The weight gradients go where their owner says (:mod:`moeshard.ep._weight_grads`: added into the gradient that
is already there, or handed over unformed as factors).

**Low-rank deltas (adapters)** (:mod:`moeshard.ep._lowrank`): each weight may carry a
:class:`~moeshard.ep._lowrank.LowRankDelta`, applied by rank-``r`` grouped GEMMs beside the base ones. Biases, an
activation spec and low-rank deltas combine freely; the biases apply to the base GEMM plus its delta
(``x (W_e + s · B_e A_e)ᵀ + b_e``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from moeshard.ep._kernels import Activation, Kernels, gated, kernels_for, weighted_gated
from moeshard.ep._lowrank import NO_DELTAS, LowRankDelta
from moeshard.ep._options import RECOMPUTES
from moeshard.ep._weight_grads import Handoff, add_into

__all__ = ["NO_BIASES", "ExpertPass"]

_EAGER = kernels_for("eager")  # the loop backend's pointwise functions

NO_BIASES: tuple[None, None] = (None, None)


class ExpertPass:
    """One expert-MLP pass with a hand-written backward (for autograd Functions that schedule their own work).

    ``forward`` returns the output and the tensors backward needs (give them to ``ctx.save_for_backward``, so
    activation checkpointing can drop and recompute them like any saved tensor); ``backward`` takes them back.
    """

    def __init__(
        self,
        counts_E: torch.Tensor,
        host_counts: Sequence[int] | None,
        activation: Activation,
        gemm: str,
        kernels: Kernels,
        offsets: torch.Tensor | None = None,
        recompute: str = "none",
    ):
        """
        Args:
            counts_E: rows per local expert (int tensor on the rows' device).
            host_counts: the same as host ints; required by the loop backend, unused by grouped_mm.
            activation: a name of ``ACTIVATIONS`` or a spec (``ClampedSwiGLU``).
            gemm: ``"grouped_mm"`` or ``"loop"`` (resolved, see :func:`resolve_gemm`).
            kernels: the kernel tier (the gated activation of the grouped_mm backend).
            offsets: the int32 cumulative ``counts_E`` when the caller computed them already (grouped_mm).
            recompute: ``"none"``, ``"activation"`` or ``"mlp"``: what backward recomputes instead of keeping it
                (see ``EPOptions.recompute``); the saved tuple holds only the rest.
        """
        assert gemm in ("grouped_mm", "loop"), gemm
        assert recompute in RECOMPUTES, recompute
        assert gemm == "grouped_mm" or host_counts is not None, "the loop backend needs the counts on the host"
        self.counts_E, self.host = counts_E, None if host_counts is None else list(host_counts)
        self.activation, self.gemm, self.kernels = activation, gemm, kernels
        self.offs = offsets
        self.recompute = recompute
        self.row_experts: torch.Tensor | None = None  # each row's local expert, for the biases (built once)

    def forward(self, x_ND, w_gate_up, w_down, s_N=None, output: bool = True, deltas=NO_DELTAS, biases=NO_BIASES):
        """``(y_ND, saved)``: the output and the tensors :meth:`backward` takes back.

        ``s_N``: each row's routing weight (float32) or None. With it the output rows come out weighted,
        ``y_n = s_n · down(act(gate x_n) · up x_n)``: the weight scales the gated activation before the down
        projection, so nothing of the output is needed for its gradient (it comes from the activation).
        ``output=False``: ``y_ND`` is None, the down projection is not run (a recompute that discards its
        outputs); ``saved`` is the same. ``deltas``: a :class:`LowRankDelta` or None per weight (gate/up, down);
        ``biases``: ``(b_gate_up [E, X] | None, b_down [E, D] | None)``."""
        h_NX = self._gate_up(x_ND, w_gate_up, deltas[0], biases[0])
        a_NF = self._gated(h_NX, s_N)
        y_ND = self._down(a_NF, w_down, deltas[1]) if output else None
        if output and biases[1] is not None:
            y_ND = y_ND + self._down_bias(biases[1], s_N, x_ND)
        kept = {"none": (x_ND, h_NX, a_NF), "activation": (x_ND, h_NX), "mlp": (x_ND,)}[self.recompute]
        return y_ND, (s_N, *kept)

    def _gate_up(self, x_ND, w_gate_up, delta=None, b_EX=None):
        """``h_NX``: each expert's gate/up GEMM on its rows (plus its low-rank delta's and its bias where given)."""
        if self.gemm == "grouped_mm" and self.offs is None:
            self.offs = torch.cumsum(self.counts_E.to(x_ND.device), 0, dtype=torch.int32)
        h_NX = self._rows(x_ND, w_gate_up.transpose(-2, -1))
        if delta is not None:
            h_NX = h_NX + self._delta_rows(x_ND, delta)
        return h_NX if b_EX is None else h_NX + b_EX.index_select(0, self._row_experts(x_ND))

    def _down(self, a_NF, w_down, delta=None):
        """``y_ND``: each expert's down projection of its rows' gated activation (plus its low-rank delta's)."""
        y_ND = self._rows(a_NF, w_down.transpose(-2, -1))
        return y_ND if delta is None else y_ND + self._delta_rows(a_NF, delta)

    def _row_experts(self, x_ND) -> torch.Tensor:
        """``[N]``: each row's local expert (from the device counts, no host sync; the loop's host counts)."""
        if self.row_experts is None:
            n = x_ND.shape[0]
            if self.host is not None:
                counts = torch.tensor(self.host, dtype=torch.int64)
                e = torch.repeat_interleave(torch.arange(len(self.host)), counts, output_size=n).to(x_ND.device)
            else:
                counts = self.counts_E.to(x_ND.device)
                e = torch.repeat_interleave(torch.arange(counts.numel(), device=x_ND.device), counts, output_size=n)
            self.row_experts = e
        return self.row_experts

    def _down_bias(self, b_ED, s_N, x_ND):
        """Each row's down bias, times its routing weight (in float32) where given, in the rows' dtype."""
        rows_ND = b_ED.index_select(0, self._row_experts(x_ND))
        return rows_ND if s_N is None else (rows_ND.float() * s_N.float().unsqueeze(-1)).to(rows_ND.dtype)

    def bias_grads(self, grad_ND, gh_NX, s_N, biases, x_ND):
        """``(grad b_gate_up, grad b_down, the down bias's part of grad s)``; None where that bias is None."""
        b_gu, b_d = biases
        gb1 = gb2 = gs_N = None
        if b_gu is not None:
            rows = self._row_experts(x_ND)
            gb1 = torch.zeros(b_gu.shape, dtype=torch.float32, device=gh_NX.device)
            gb1 = gb1.index_add_(0, rows, gh_NX.float()).to(b_gu.dtype)
        if b_d is not None:
            rows = self._row_experts(x_ND)
            g_ND = grad_ND.float() if s_N is None else grad_ND.float() * s_N.float().unsqueeze(-1)
            gb2 = torch.zeros(b_d.shape, dtype=torch.float32, device=grad_ND.device).index_add_(0, rows, g_ND)
            gb2 = gb2.to(b_d.dtype)
            if s_N is not None:
                gs_N = (grad_ND.float() * b_d.index_select(0, rows).float()).sum(-1)
        return gb1, gb2, gs_N

    def _rows(self, x_NK, w_EKM):
        """``x_n @ w_e`` for each row ``n`` of expert ``e``: ``[N, M]``."""
        if self.gemm == "grouped_mm":
            return F.grouped_mm(x_NK, w_EKM, offs=self.offs)
        parts = [x_NK[s : s + n] @ w_EKM[e] for e, (s, n) in enumerate(self._spans())]
        return torch.cat(parts) if parts else x_NK.new_zeros((0, w_EKM.shape[-1]))

    def _per_expert(self, a_NM, b_NK):
        """``Σ_n a_nᵀ b_n`` over each expert's rows: ``[E, M, K]``, zeros for an expert without rows."""
        if self.gemm == "grouped_mm":
            return F.grouped_mm(a_NM.transpose(0, 1), b_NK, offs=self.offs)
        return torch.stack([a_NM[s : s + n].transpose(0, 1) @ b_NK[s : s + n] for s, n in self._spans()])

    def _delta_rows(self, x_NK, delta: LowRankDelta):
        """``s · (x A_eᵀ) B_eᵀ`` per row: the delta's output, rank-``r`` GEMMs only (scaled at rank ``r``, not over
        the output rows)."""
        t_Nr = self._rows(x_NK, delta.A.transpose(-2, -1)) * delta.scaling
        return self._rows(t_Nr, delta.B.transpose(-2, -1))

    def _delta_input_grad(self, g_NM, delta: LowRankDelta):
        """``s · g B_e``: the gradient at ``x A_eᵀ`` for the delta output's gradient ``g_NM`` (rank ``r``)."""
        return (self._rows(g_NM, delta.B) * delta.scaling).contiguous()

    def _delta_backward(self, g_NM, x_NK, delta: LowRankDelta, need_x: bool, u_Nr=None):
        """``(grad x part | None, grad A, grad B)`` of :meth:`_delta_rows` for its output's gradient ``g_NM``
        (``u_Nr``: :meth:`_delta_input_grad` where the caller has it already)."""
        u_Nr = self._delta_input_grad(g_NM, delta) if u_Nr is None else u_Nr  # the gradient at x A_eᵀ
        t_Nr = self._rows(x_NK, delta.A.transpose(-2, -1)).contiguous()  # recomputed: rank r, cheaper than keeping
        gB = self._per_expert(g_NM, t_Nr) * delta.scaling
        gA = self._per_expert(u_Nr, x_NK)
        return (self._rows(u_Nr, delta.A) if need_x else None), gA, gB

    def _gated(self, h_NX, s_N):
        """``a_NF``: the gated activation of the gate/up output, times ``s_N`` where given (the kernel tier's with
        grouped_mm, the eager functions with the loop)."""
        if self.gemm == "grouped_mm":
            k = self.kernels
            a_NF = k.gated(self.activation, h_NX) if s_N is None else k.weighted_gated(self.activation, h_NX, s_N)
            return a_NF.contiguous()
        return gated(self.activation, h_NX) if s_N is None else weighted_gated(self.activation, h_NX, s_N)

    def _gated_backward(self, h_NX, ga_NF, s_N, need_a: bool):
        """``(grad h, grad s | None, a | None)``: the gated activation's gradients, and with ``need_a`` its output
        again (recomputed for the down projection's weight gradient when forward did not keep it)."""
        k = self.kernels if self.gemm == "grouped_mm" else _EAGER
        if s_N is not None:
            gh_NX, gs_N, a_NF = k.weighted_gated_backward(self.activation, h_NX, ga_NF, s_N, need_a)
            return gh_NX.contiguous(), gs_N, a_NF
        a_NF = k.gated(self.activation, h_NX).contiguous() if need_a else None
        return k.gated_backward(self.activation, h_NX, ga_NF).contiguous(), None, a_NF

    def _spans(self):
        start = 0
        for n in self.host:
            yield start, n
            start += n

    def backward(
        self,
        grad_ND,
        saved,
        w_gate_up,
        w_down,
        need_x: bool,
        need_w: bool,
        into=(None, None),
        deltas=NO_DELTAS,
        biases=NO_BIASES,
    ):
        """``(grad x, grad w_gate_up, grad w_down, grad s, bias grads, delta grads)``; None where not needed
        (``grad s``: where forward had no routing weights). Every expert's weight gradient is produced (zeros for an
        expert without rows), so every rank reduces the same set of gradients. ``need_w`` False (a frozen base): no
        weight-gradient GEMM runs.

        ``into``: a buffer per weight (gate/up, down) or None: a weight with a buffer gets this pass's gradient
        added into it (see :data:`WeightGradTarget`) and None in the returned tuple.
        ``deltas``, ``biases``: forward's; ``bias grads`` is ``(grad b_gate_up, grad b_down)``, None where that bias
        is None; ``delta grads`` is ``(grad A, grad B)`` or None per weight, the same order."""
        s_N, x_ND, *kept = saved
        d1, d2 = deltas
        h_NX = kept[0] if kept else self._gate_up(x_ND, w_gate_up, d1, biases[0])
        a_kept = kept[1] if len(kept) > 1 else None
        need_a = (need_w or d2 is not None) and a_kept is None
        grad_ND = grad_ND.contiguous()
        gx = gw1 = gw2 = None
        if self.gemm == "grouped_mm" or d1 is not None or d2 is not None:
            # one grouped pass over all experts (the loop backend's per-expert GEMMs stand in for grouped_mm here)
            ga_NF = self._rows(grad_ND, w_down)
            u2_Nr = None
            if d2 is not None:
                u2_Nr = self._delta_input_grad(grad_ND, d2)
                ga_NF = ga_NF + self._rows(u2_Nr, d2.A)
            gh_NX, gs_N, a_NF = self._gated_backward(h_NX, ga_NF, s_N, need_a)  # pointwise: rows in one call
            a_NF = a_NF if a_kept is None else a_kept
            offs = self._offsets(grad_ND.device)
            if need_w:
                gw2 = self._weight_grad(grad_ND, a_NF, into[1], offs)
            g2 = None if d2 is None else self._delta_backward(grad_ND, a_NF, d2, False, u2_Nr)[1:]
            del u2_Nr  # rank r rows, but not alive at the peak below (backward_elements)
            if need_x:
                gx = self._rows(gh_NX, w_gate_up)
            g1 = None
            if d1 is not None:
                gx1, *g1 = self._delta_backward(gh_NX, x_ND, d1, need_x)
                gx = gx + gx1 if need_x else None
                g1 = tuple(g1)
            if need_w:
                gw1 = self._weight_grad(gh_NX, x_ND, into[0], offs)
            gs_N, gb = self._with_bias_grads(grad_ND, gh_NX, s_N, gs_N, biases, x_ND)
            return gx, gw1, gw2, gs_N, gb, (g1, g2)
        gxs, ghs, a_s, gss = [], [], [], []
        for e, (s, n) in enumerate(self._spans()):
            g_nD = grad_ND[s : s + n]
            ga_nF = g_nD @ w_down[e]
            s_n = None if s_N is None else s_N[s : s + n]
            gh_nX, gs_n, a_nF = self._gated_backward(h_NX[s : s + n], ga_nF, s_n, need_a)
            gxs.append(gh_nX @ w_gate_up[e])
            ghs.append(gh_nX)
            a_s.append(a_nF if a_kept is None else a_kept[s : s + n])
            gss.append(gs_n)
        if need_x:
            gx = torch.cat(gxs) if gxs else grad_ND.new_zeros((0, w_gate_up.shape[-1]))
        gh_NX = None
        if need_w or biases[0] is not None:
            gh_NX = torch.cat(ghs) if ghs else grad_ND.new_zeros((0, w_gate_up.shape[1]))
        if need_w:
            offs = self._offsets(grad_ND.device)
            a_NF = torch.cat(a_s) if a_s else grad_ND.new_zeros((0, w_down.shape[2]))
            gw2 = self._weight_grad(grad_ND, a_NF, into[1], offs)
            gw1 = self._weight_grad(gh_NX, x_ND, into[0], offs)
        gs_N = None if s_N is None else (torch.cat(gss) if gss else s_N.new_zeros(0))
        gs_N, gb = self._with_bias_grads(grad_ND, gh_NX, s_N, gs_N, biases, x_ND)
        return gx, gw1, gw2, gs_N, gb, (None, None)

    def _with_bias_grads(self, grad_ND, gh_NX, s_N, gs_N, biases, x_ND):
        """``(grad s, (grad b_gate_up, grad b_down))``: the biases' gradients and the down bias's part of grad s."""
        if biases[0] is None and biases[1] is None:
            return gs_N, NO_BIASES
        gb1, gb2, gs_bias = self.bias_grads(grad_ND, gh_NX, s_N, biases, x_ND)
        if gs_bias is not None:
            gs_N = gs_bias if gs_N is None else gs_N + gs_bias
        return gs_N, (gb1, gb2)

    def _offsets(self, device):
        """The int32 row ends per expert (the grouped_mm backend's own; built from the host counts for the loop)."""
        if self.gemm == "grouped_mm":
            return self.offs
        return torch.tensor(list(itertools.accumulate(self.host)), dtype=torch.int32, device=device)

    def _weight_grad(self, a_NM, b_NK, into, offs):
        """Each expert's ``a[rows]^T @ b[rows]``: taken by the target as factors, added into its buffer (None), or a
        new tensor."""
        if isinstance(into, Handoff):
            taken, into = into.resolve(a_NM, b_NK, offs, self.kernels if self.gemm == "grouped_mm" else _EAGER)
            if taken:
                return None
        if self.gemm == "loop":
            spans = list(self._spans())
            if not spans:
                return a_NM.new_zeros((0, a_NM.shape[1], b_NK.shape[1]))
            grad = torch.stack([a_NM[s : s + n].transpose(0, 1) @ b_NK[s : s + n] for s, n in spans])
            return add_into(grad, into)
        if into is None:
            return F.grouped_mm(a_NM.transpose(0, 1), b_NK, offs=offs)
        self.kernels.weight_grad_into(a_NM, b_NK, offs, into)
        return None
