"""EP size P > 1 with the exchange overlapped by the rank's own expert work (the default strategy).

# D hidden, El local experts, P EP size, N routed copies of this rank (sorted by global expert), M copies
# received from the other ranks

Every routed copy bound for another rank travels; a rank's copies for its own experts never do. Flow of
:meth:`OverlappedDispatch.run_experts`, given the copies sorted by global expert (so grouped by destination
rank, then by local expert there):

1. exchange the per-expert counts (one small ``all_to_all_single``) and queue everything the device can prepare
   without the split sizes (the three expert passes' row counts and GEMM offsets): after the sync the device
   idles until the host launches again, so host work left there delays the layer;
2. the layer's one device→host sync: one ``.tolist()`` of the sent and received counts;
3. (:class:`_OverlappedExperts`) post the sends/receives of the remote copies and their routing weights (one
   batch of point-to-point ops) and run half A of the own copies' experts meanwhile; run the received copies;
   post their outputs home and run half B meanwhile. Backward mirrors it: the output gradients of remote copies
   travel during half A's backward, the input and routing-weight gradients go home during half B's.

The received copies come in source-rank order, each source's rows grouped by local expert; with several
sources one permutation gather groups them by local expert (and one takes the outputs back), while the rows of
a single source (EP 2: the one other rank) already are in that order and need none. While a GEMM overlaps an
exchange it leaves ``EPOptions.sm_carveout`` SMs to the communication kernel (CUDA): the grouped GEMM (and
cuBLAS) otherwise sizes its persistent grid to every SM and the exchange waits for the GEMM to finish.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.ep._dispatch._base import ExpertDispatch
from moeshard.ep._expert_pass import NO_BIASES, ExpertPass
from moeshard.ep._kernels import Kernels, resolve_gemm
from moeshard.ep._lowrank import NO_DELTAS, _deltas, delta_inputs
from moeshard.ep._mlp import check_biases
from moeshard.ep._permute import inverse_permutation, regroup_by_local_expert
from moeshard.ep._torch_internals import set_sm_carveout, sm_carveout
from moeshard.ep._weight_grads import Handoff, add_into, takes_factors, weight_grad_buffers

__all__ = ["OverlappedDispatch"]


class OverlappedDispatch(ExpertDispatch):
    """The routed experts of one MoE layer over an EP group of 2+ ranks, exchanges overlapped with own work."""

    @classmethod
    def kept_factor_elements(cls, rows: int, hidden: int, width: int, ep_size: int) -> float:
        """:meth:`ExpertDispatch.kept_factor_elements`, plus what the factors of the rank's own copies hold beyond
        them: they are views of all the copies it sorted and of their output gradient (those sent to other ranks
        too), ``N · 2D · (P - 1) / P`` more."""
        own = super().kept_factor_elements(rows, hidden, width, ep_size)
        return own + rows * 2 * hidden * (ep_size - 1) / ep_size

    def run_experts(
        self,
        x_sorted_ND,
        w_sorted_N,
        counts_E,
        w_gate_up_EXD,
        w_down_EDF,
        activation,
        deltas=NO_DELTAS,
        biases=NO_BIASES,
    ) -> torch.Tensor:
        """The copies to their experts' ranks and back (see :meth:`ExpertDispatch.run_experts`)."""
        check_biases(biases, w_gate_up_EXD, w_down_EDF)
        P, El, me = self.ep_size, w_gate_up_EXD.shape[0], self.ep_rank
        recv_counts_E = self.exchange_counts(counts_E)  # El counts to and from each rank; replayed in a recompute
        local_E = counts_E.view(P, El)[me]
        recv_PEl = recv_counts_E.view(P, El)
        sources_SEl = torch.cat([recv_PEl[:me], recv_PEl[me + 1 :]])  # the other ranks: own copies stay
        half = El // 2
        device_counts = (local_E[:half], sources_SEl.sum(0), local_E[half:])
        offsets = tuple(torch.cumsum(c, 0, dtype=torch.int32) for c in device_counts)
        # The one device→host sync of the layer: both count tensors in one .tolist(), not two.
        host = self.host_sizes(counts_E, recv_counts_E)  # replayed in a checkpoint recompute
        gemm = resolve_gemm(self.options.gemm, x_sorted_ND, w_gate_up_EXD)
        ex = _Exchange(self, El, host[: P * El], host[P * El :], sources_SEl, device_counts, offsets, gemm, activation)
        lowrank = delta_inputs(deltas, (w_gate_up_EXD, w_down_EDF), x_sorted_ND.dtype)
        return _OverlappedExperts.apply(
            x_sorted_ND, w_sorted_N, w_gate_up_EXD, w_down_EDF, ex, self.weight_grads, *biases, *lowrank
        )


class _Exchange:
    """Host-side layout of one layer's copies exchange (from the split sizes), the device counts and how to run.

    ``send``: ``(peer, first row, rows)`` of the sorted copies going to each other rank; ``recv``: the same for
    the buffer of copies received from the other ranks (source-rank order, each source's rows grouped by local
    expert); ``local``: ``(first row, rows)`` of this rank's own copies, which never travel.
    """

    def __init__(
        self, d: OverlappedDispatch, El, send_counts, recv_counts, sources_SEl, device_counts, offsets, gemm, activation
    ):
        self.group, self.activation, self.gemm = d.group, activation, gemm
        self.kernels: Kernels = d.kernels
        self.sm_carveout, self.recompute = d.options.sm_carveout, d.options.recompute
        self.output = not d.outputs_discarded  # False: a recompute that discards its outputs (no way back)
        # (half A of the own copies, the received copies, half B): device counts and int32 GEMM offsets
        self.device_counts, self.offsets = device_counts, offsets
        P, me, group = d.ep_size, d.ep_rank, d.group
        others = [r for r in range(P) if r != me]
        send = [sum(send_counts[r * El : (r + 1) * El]) for r in range(P)]
        recv = [sum(recv_counts[r * El : (r + 1) * El]) for r in range(P)]
        starts = [sum(send[:r]) for r in range(P)]
        self.local = (starts[me], send[me])
        self.send = [(dist.get_global_rank(group, r), starts[r], send[r]) for r in others]
        rstarts = [sum(recv[o] for o in others[:i]) for i in range(len(others))]
        self.recv = [(dist.get_global_rank(group, r), s, recv[r]) for r, s in zip(others, rstarts)]
        self.rows_in = sum(recv[r] for r in others)
        self.local_host = send_counts[me * El : (me + 1) * El]
        self.remote_host = [sum(recv_counts[r * El + e] for r in others) for e in range(El)]
        perm = regroup_by_local_expert(sources_SEl, self.rows_in)  # None for one source
        self.perm = None if perm is None else (perm, inverse_permutation(perm))

    def start(self, pairs, src_slices, dst_slices) -> list:
        """Post, for each ``(src, dst)`` of ``pairs`` (tensors sliced along dim 0 alike), the sends of ``src``'s
        slices and the receives into ``dst``'s slices, all in one batch; returns the works."""
        ops = []
        for src, dst in pairs:
            ops += [dist.P2POp(dist.isend, src[s : s + n], peer, self.group) for peer, s, n in src_slices if n]
            ops += [dist.P2POp(dist.irecv, dst[s : s + n], peer, self.group) for peer, s, n in dst_slices if n]
        return dist.batch_isend_irecv(ops) if ops else []

    def carveout(self, device: torch.device, busy: bool) -> _Carveout:
        """While ``busy`` (an exchange in flight), GEMMs leave ``sm_carveout`` SMs free (CUDA only)."""
        return _Carveout(busy and device.type == "cuda" and self.sm_carveout > 0, self.sm_carveout)


class _Carveout:
    def __init__(self, on: bool, sms: int):
        self.on, self.sms, self.before = on, sms, None

    def __enter__(self):
        if self.on:
            self.before = sm_carveout()
            set_sm_carveout(self.sms)

    def __exit__(self, *exc):
        if self.on:
            set_sm_carveout(self.before)


def _widen(offsets: torch.Tensor, first: int, total: int) -> torch.Tensor:
    """The row ends of a pass over experts ``[first, first + len(offsets))`` as row ends over all ``total`` experts
    (no rows before the first, none after the last)."""
    parts = [offsets.new_zeros(first)] if first else []
    parts.append(offsets)
    rest = total - first - offsets.numel()
    if rest and offsets.numel():
        parts.append(offsets[-1:].expand(rest))
    return torch.cat(parts) if len(parts) > 1 else offsets


def _sliced(deltas, sl: slice):
    """The deltas of the local experts ``sl`` (a half's)."""
    return tuple(None if d is None else d.experts(sl) for d in deltas)


def _sliced_biases(biases, sl: slice) -> tuple:
    """The biases of the local experts ``sl`` (a half's; None stays None)."""
    return tuple(None if b is None else b[sl] for b in biases)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _LocalHalf:
    """A contiguous range of local experts and their rows among this rank's own (never travelling) copies."""

    def __init__(self, ex: _Exchange, first: int, last: int, which: int):
        lo, _ = ex.local
        counts = ex.local_host
        self.experts = slice(first, last)
        self.rows = slice(lo + sum(counts[:first]), lo + sum(counts[:last]))
        self.run = ExpertPass(
            ex.device_counts[which],
            counts[first:last],
            ex.activation,
            ex.gemm,
            ex.kernels,
            offsets=ex.offsets[which],
            recompute=ex.recompute,
        )


def _whole(remote: torch.Tensor | None, halves, El: int) -> torch.Tensor | None:
    """One weight's gradient over all ``El`` local experts from the received copies' pass (``remote``, every expert)
    and the halves' (``(half, gradient of its experts)``): the halves added into the remote's slices, in the order
    autograd's accumulation adds them; None where every part went to the target as factors."""
    if remote is None:
        present = [(part, g) for part, g in halves if g is not None]
        if not present:
            return None
        remote = present[0][1].new_zeros((El, *present[0][1].shape[1:]))
    for part, g in halves:
        if g is not None:
            remote[part.experts].add_(g)
    return remote


class _Collect(Handoff):
    """One pass's gradient of one weight where the passes' gradients are formed together (``Kernels.sums_parts``):
    offered to the target as factors first (``offer``), else kept in ``parts`` for :func:`_formed`."""

    def __init__(self, target, weight, offsets, parts: list, offer: bool):
        super().__init__(target, weight, offsets, buffer=False)
        self.parts, self.offer = parts, offer

    def resolve(self, a_NM, b_NK, offsets, kernels):  # noqa: D102
        if self.offer and super().resolve(a_NM, b_NK, offsets, kernels)[0]:
            return True, None
        self.parts.append((a_NM, b_NK, self.offsets))
        return True, None


def _formed(target, weight: torch.Tensor, parts: list, kernels: Kernels) -> torch.Tensor | None:
    """The kept passes' gradient of ``weight`` in one ``weight_grad_sum``: added into the target's buffer (None
    returned), or a new gradient; None where the target took every part."""
    if not parts:
        return None
    buffer = target(weight) if target is not None else None
    if buffer is not None:
        kernels.weight_grad_sum(parts, buffer, True)
        return None
    grad = parts[0][0].new_empty((weight.shape[0], parts[0][0].shape[1], parts[0][1].shape[1]))
    kernels.weight_grad_sum(parts, grad, False)
    return grad


class _OverlappedExperts(torch.autograd.Function):
    """The copies' trip through the experts of their EP ranks, with both exchanges overlapped by local work.

    The three expert passes (half A, the received copies, half B) are :class:`ExpertPass` es whose inputs are
    saved with ``save_for_backward``, so activation checkpointing recomputes the layer once, as for any op;
    each half works on its slice of the weights and its weight gradients are added into the slices of the
    remote pass's.
    """

    @staticmethod
    def forward(  # noqa: D102
        ctx, x_sorted_ND, w_sorted_N, w_gate_up_EXD, w_down_EDF, ex: _Exchange, target, b1, b2, scalings, A1, B1, A2, B2
    ):
        deltas = _deltas(scalings, A1, B1, A2, B2)
        N, D = x_sorted_ND.shape
        El = w_gate_up_EXD.shape[0]
        half_a, half_b = _LocalHalf(ex, 0, El // 2, 0), _LocalHalf(ex, El // 2, El, 2)
        remote = ExpertPass(
            ex.device_counts[1], ex.remote_host, ex.activation, ex.gemm, ex.kernels, ex.offsets[1], ex.recompute
        )
        dev = x_sorted_ND.device

        def local(part):
            if part.experts.start == part.experts.stop:
                return None, ()
            sl = part.experts
            x, s = x_sorted_ND[part.rows], w_sorted_N[part.rows]
            return part.run.forward(
                x, w_gate_up_EXD[sl], w_down_EDF[sl], s, ex.output, _sliced(deltas, sl), _sliced_biases((b1, b2), sl)
            )

        recv_MD = x_sorted_ND.new_empty((ex.rows_in, D))
        recv_M = w_sorted_N.new_empty(ex.rows_in)
        works = ex.start(((x_sorted_ND, recv_MD), (w_sorted_N, recv_M)), ex.send, ex.recv)
        with ex.carveout(dev, bool(works)):
            y_a, saved_a = local(half_a)
        _wait(works)
        x_in = recv_MD if ex.perm is None else recv_MD.index_select(0, ex.perm[0])
        w_in = recv_M if ex.perm is None else recv_M.index_select(0, ex.perm[0])
        y_rem, saved_r = remote.forward(x_in, w_gate_up_EXD, w_down_EDF, w_in, ex.output, deltas, (b1, b2))
        if ex.perm is not None and ex.output:
            y_rem = y_rem.index_select(0, ex.perm[1])
        y_sorted_ND = x_sorted_ND.new_empty((N, D))
        # The outputs home; not in a recompute that discards them (every rank of the group recomputes the same
        # layer in its backward, so all skip this exchange alike).
        works = ex.start(((y_rem, y_sorted_ND),), ex.recv, ex.send) if ex.output else []
        with ex.carveout(dev, bool(works)):
            y_b, saved_b = local(half_b)
        for part, y in ((half_a, y_a), (half_b, y_b)):
            if y is not None:
                y_sorted_ND[part.rows].copy_(y)
        _wait(works)
        ctx.ex, ctx.passes, ctx.target, ctx.scalings = ex, (half_a, remote, half_b), target, scalings
        ctx.sizes = (len(saved_a), len(saved_r), len(saved_b))
        ctx.save_for_backward(w_gate_up_EXD, w_down_EDF, b1, b2, A1, B1, A2, B2, *saved_a, *saved_r, *saved_b)
        return y_sorted_ND

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: D102
        ex = ctx.ex
        half_a, remote, half_b = ctx.passes
        w1, w2, b1, b2, A1, B1, A2, B2, *saved = ctx.saved_tensors
        deltas, biases = _deltas(ctx.scalings, A1, B1, A2, B2), (b1, b2)
        na, nr, _ = ctx.sizes
        saved_a, saved_r, saved_b = saved[:na], saved[na : na + nr], saved[na + nr :]
        need_x, need_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_w1, need_w2 = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        need_w, El = need_w1 or need_w2, w1.shape[0]

        # An expert's gradient has parts in two passes here (its own copies' half and the received copies). A target
        # that takes factors is offered each pass's, with row ends over all El experts. What it does not take is
        # formed from all passes at once where the kernel tier sums parts in one pass over the gradient
        # (``Kernels.sums_parts``: written, or added into the target's buffer, once); elsewhere each pass's gradient
        # is formed and they are summed (the halves into the received pass's slices, in the order autograd's
        # accumulation adds them: bf16 sums in another order differ where the parts nearly cancel), then added into
        # the target's buffer once.
        offer_factors = need_w and takes_factors(ctx.target)
        collect = need_w and ex.gemm == "grouped_mm" and ex.kernels.sums_parts(grad_ND)
        widened = None
        if offer_factors or collect:
            first_b = half_b.experts.start
            widened = (_widen(ex.offsets[0], 0, El), ex.offsets[1], _widen(ex.offsets[2], first_b, El))
        kept = ([], []) if collect else None

        def offer(which: int):
            if widened is None:
                return None, None
            offsets, target = widened[which], ctx.target
            if collect:
                return tuple(
                    _Collect(target, w, offsets, kept[i], offer_factors) if need else None
                    for i, (w, need) in enumerate(((w1, need_w1), (w2, need_w2)))
                )
            w1_to = Handoff(target, w1, offsets, buffer=False) if need_w1 else None
            return w1_to, Handoff(target, w2, offsets, buffer=False) if need_w2 else None

        grad_ND = grad_ND.contiguous()
        N, D = grad_ND.shape
        dev = grad_ND.device

        def local(part, saved_part, which):
            if not saved_part:
                return None, None, None, None, NO_BIASES, NO_DELTAS
            sl = part.experts
            return part.run.backward(
                grad_ND[part.rows],
                saved_part,
                w1[sl],
                w2[sl],
                need_x,
                need_w,
                offer(which),
                _sliced(deltas, sl),
                _sliced_biases(biases, sl),
            )

        grad_in_MD = grad_ND.new_empty((ex.rows_in, D))
        works = ex.start(((grad_ND, grad_in_MD),), ex.send, ex.recv)
        with ex.carveout(dev, bool(works)):
            gx_a, gw1_a, gw2_a, gs_a, gb_a, gd_a = local(half_a, saved_a, 0)
        _wait(works)
        g_rem = grad_in_MD if ex.perm is None else grad_in_MD.index_select(0, ex.perm[0])
        gx_rem, gw1, gw2, gs_rem, gb_rem, gd_rem = remote.backward(
            g_rem, saved_r, w1, w2, need_x, need_w, offer(1), deltas, biases
        )
        # the remote copies' input and routing-weight gradients go home, in one batch
        home, gx, gs = [], None, None
        if need_x:
            gx = grad_ND.new_empty((N, D))
            home.append((gx_rem if ex.perm is None else gx_rem.index_select(0, ex.perm[1]), gx))
        if need_s:
            gs = torch.empty(N, dtype=torch.float32, device=dev)
            home.append((gs_rem if ex.perm is None else gs_rem.index_select(0, ex.perm[1]), gs))
        works = ex.start(home, ex.recv, ex.send) if home else []
        with ex.carveout(dev, bool(works)):
            gx_b, gw1_b, gw2_b, gs_b, gb_b, gd_b = local(half_b, saved_b, 2)
        for full, parts in ((gx, (gx_a, gx_b)), (gs, (gs_a, gs_b))):
            if full is not None:
                for part, g in zip((half_a, half_b), parts):
                    if g is not None:
                        full[part.rows].copy_(g)
        if collect:
            gw1, gw2 = (_formed(ctx.target, w, k, ex.kernels) for w, k in zip((w1, w2), kept))
        else:
            gw1 = _whole(gw1, ((half_a, gw1_a), (half_b, gw1_b)), El)
            gw2 = _whole(gw2, ((half_a, gw2_a), (half_b, gw2_b)), El)
            into = weight_grad_buffers(ctx.target, w1, w2, need_w1 and gw1 is not None, need_w2 and gw2 is not None)
            gw1, gw2 = add_into(gw1, into[0]), add_into(gw2, into[1])
        # the biases' gradients: the received copies' pass covers every local expert, the halves add their slices
        gb = [_whole(gb_rem[i], ((half_a, gb_a[i]), (half_b, gb_b[i])), El) for i in range(2)]
        gb = [g if need else None for g, need in zip(gb, ctx.needs_input_grad[6:8])]
        # the deltas' gradients: the halves' added into the slices of the received copies' pass, like the weights'
        gd = []
        for i in range(4):
            parts = [None if g[i // 2] is None else g[i // 2][i % 2] for g in (gd_a, gd_rem, gd_b)]
            gd.append(_whole(parts[1], ((half_a, parts[0]), (half_b, parts[2])), El))
        gd = [g if need else None for g, need in zip(gd, ctx.needs_input_grad[9:])]
        _wait(works)
        return gx, gs, gw1 if need_w1 else None, gw2 if need_w2 else None, None, None, *gb, None, *gd
