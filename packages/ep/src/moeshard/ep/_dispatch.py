"""Routed experts of one MoE layer: token dispatch (all-to-all), grouped expert GEMM, combine.

# T tokens, K top-k, D hidden, E experts (global unless said), El local experts, F expert width,
# N routed copies (T*K) sent by this rank, R copies received by this rank, P EP size

Flow with EP size 1: sort the N = T*K token copies by expert (stable), one grouped GEMM, un-sort and add each
token's K copies, weighted, in float32.

Flow with EP size P > 1, dispatch "copies" (the default): every copy bound for another rank travels, a rank's
copies for its own experts never do. Sort the copies by global expert (grouped by destination rank too, since
expert g lives on rank g // El), exchange per-expert counts, one ``.tolist()`` (the layer's host sync), then
(``_OverlappedExperts``): post the sends/receives of the remote copies (one batch of point-to-point ops) and run
half of the own copies' experts meanwhile; run the received copies (from one source they arrive grouped by local
expert: no regrouping with P = 2; with more sources one permutation gather); post their outputs home and run the
other half meanwhile; un-sort and combine weighted in float32 (one fused gather-and-sum). Backward mirrors the
overlap. While a GEMM overlaps an exchange it leaves SMs to the communication kernel (SM carveout).

Flow with EP size P > 1, dispatch "tokens" (de-duplication: a token travels once to each rank that holds any of
its experts, not once per expert; with top-8 of 128 experts on 2 ranks that is ~4x fewer bytes):

1. per destination rank: which tokens go there (``hit_PT``) and how many copies each of its local experts gets;
2. exchange those counts with one small ``all_to_all_single``;
3. the single host sync: one ``.tolist()`` of sent and received counts gives the split sizes;
4. send the tokens, their K local expert ids (``El`` = "not on your rank") and routing weights;
5. the receiver sorts the received copies by local expert, runs one grouped GEMM, and adds each token's copies
   weighted in float32 into one partial output per received token;
6. the partial outputs go back (reverse all-to-all) and the sender adds them per token in float32.

The token, weight and output all-to-alls are an autograd Function whose backward is the reverse all-to-all, so input and expert-weight
gradients come home to the rank that owns them.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from moeshard.ep._grouped import KERNELS, Backend, ExpertPass, _activation, _resolve_backend, grouped_expert_mlp

__all__ = [
    "Dispatch",
    "get_ep_dispatch",
    "register_host_sync_hook",
    "routed_experts",
    "set_compiled_kernels",
    "set_ep_dispatch",
]

Dispatch = Literal["tokens", "copies"]
"""How tokens travel with EP > 1: ``"copies"`` (the default: every routed copy bound for another rank travels,
overlapped with the own copies' experts) or ``"tokens"`` (de-duplicated: once per destination rank, partial
outputs come back; ~4x fewer bytes at top-8 of 128 experts on 2 ranks, but more passes over memory and no
overlap). On 2 H200s over NVLink (EP 2, 8 layers of Qwen3-30B-A3B) copies measured 48.4k / 47.9k tokens/s/GPU
against 45.6k / 45.5k for tokens before the overlap (benchmarks/NOTES.md)."""
_dispatch: list[Dispatch] = ["copies"]


def set_ep_dispatch(mode: Dispatch) -> None:
    """Set the process-wide EP dispatch mode (see :data:`Dispatch`); both give the same results."""
    if mode not in ("tokens", "copies"):
        raise ValueError(f"EP dispatch must be 'tokens' or 'copies', got {mode!r}")
    _dispatch[0] = mode


_HOST_SYNC_HOOKS: OrderedDict[int, Callable[[], None]] = OrderedDict()


def register_host_sync_hook(hook: Callable[[], None]) -> RemovableHandle:
    """Call ``hook()`` right before each EP layer's device→host sync (the split sizes, forward only).

    At that point the host is about to wait for the device to catch up, so host-side work done there (e.g.
    issuing the next layer's FSDP all-gather, see ``moeshard.prefetch``) costs no device time, whereas the same
    work done after the sync delays the next kernel launches. Hooks must not launch work the sync depends on
    or synchronise themselves. Returns a handle whose ``remove()`` unregisters the hook.
    """
    handle = RemovableHandle(_HOST_SYNC_HOOKS)
    _HOST_SYNC_HOOKS[handle.id] = hook
    return handle


def _before_host_sync() -> None:
    for hook in list(_HOST_SYNC_HOOKS.values()):
        hook()


def get_ep_dispatch() -> Dispatch:
    """The process-wide EP dispatch mode."""
    return _dispatch[0]


def _weighted_sum(y_TKD: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    # Products and sum in float32: the routing weights are applied in float32 whatever the compute dtype.
    return (y_TKD.float() * w_TK.float().unsqueeze(-1)).sum(dim=1)


KERNELS["weighted_sum"] = _weighted_sum


def _unsort_weighted_sum(y_sorted_ND: torch.Tensor, inv_N: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    # The un-sort gather folded into the weighted sum (compiled: one kernel, no un-sorted copy in memory).
    T, K = w_TK.shape
    y_TKD = y_sorted_ND.index_select(0, inv_N).view(T, K, y_sorted_ND.shape[-1])
    return (y_TKD.float() * w_TK.float().unsqueeze(-1)).sum(dim=1)


def _sorted_output_grad(g_TD: torch.Tensor, order_N: torch.Tensor, w_TK: torch.Tensor, dtype: torch.dtype):
    # d y_TD / d y_sorted[n] = w of that copy, times the gradient of its token (gathered, not scattered).
    K = w_TK.shape[1]
    w_N = w_TK.reshape(-1).float().index_select(0, order_N)
    return (g_TD.index_select(0, torch.div(order_N, K, rounding_mode="floor")) * w_N.unsqueeze(-1)).to(dtype)


def _routing_weight_grad(g_TD: torch.Tensor, y_sorted_ND: torch.Tensor, inv_N: torch.Tensor, K: int):
    T = g_TD.shape[0]
    y_TKD = y_sorted_ND.index_select(0, inv_N).view(T, K, y_sorted_ND.shape[-1])
    return (y_TKD.float() * g_TD.float().unsqueeze(1)).sum(dim=-1)


def _gather_sum(grad_ND: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    # back to copy order t*K+k, then each token's K copies are adjacent: a sum (the gather folded in)
    return grad_ND.index_select(0, inv_N).view(-1, K, grad_ND.shape[-1]).sum(dim=1)


def _expand_rows(x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
    return x_TD.index_select(0, torch.div(order_N, K, rounding_mode="floor"))


def _combine_backward(g_TD, y_sorted_ND, order_N, inv_N, w_TK, need_gy: bool, need_gw: bool):
    # (grad y_sorted in y's dtype, grad w in float32), each None where not needed
    gy = KERNELS["sorted_output_grad"](g_TD, order_N, w_TK, y_sorted_ND.dtype) if need_gy else None
    gw = KERNELS["routing_weight_grad"](g_TD, y_sorted_ND, inv_N, w_TK.shape[1]) if need_gw else None
    return gy, gw


KERNELS["unsort_weighted_sum"] = _unsort_weighted_sum
KERNELS["sorted_output_grad"] = _sorted_output_grad
KERNELS["routing_weight_grad"] = _routing_weight_grad
KERNELS["gather_sum"] = _gather_sum
KERNELS["expand_rows"] = _expand_rows
KERNELS["combine_backward"] = _combine_backward
_EP_KERNELS = (
    "gated",
    "gated_backward",
    "weighted_sum",
    "unsort_weighted_sum",
    "sorted_output_grad",
    "routing_weight_grad",
    "gather_sum",
)
_EP_EAGER = {name: KERNELS[name] for name in _EP_KERNELS}


def _triton_kernels() -> dict[str, Callable] | None:
    """The kernels written in triton (``moeshard.ep._triton``: the gathers, SwiGLU's gated activation), each
    falling back to the current ``KERNELS`` entry off CUDA, or None where triton or a GPU is missing."""
    if not torch.cuda.is_available() or os.environ.get("MOESHARD_TRITON_KERNELS", "1") == "0":
        return None
    try:
        from moeshard.ep import _triton
    except ImportError:
        return None

    def combine_backward(g_TD, y_sorted_ND, order_N, inv_N, w_TK, need_gy, need_gw):
        return _triton.combine_backward(g_TD, y_sorted_ND, inv_N, w_TK, need_gy, need_gw)

    gathers = {
        "unsort_weighted_sum": _triton.unsort_weighted_sum,
        "gather_sum": _triton.gather_sum,
        "expand_rows": _triton.expand_rows,
        "combine_backward": combine_backward,
    }
    return {
        **{name: _on_cuda(fn, KERNELS[name]) for name, fn in gathers.items()},
        "gated": _silu_on_cuda(lambda act, h: _triton.gated(h), KERNELS["gated"]),
        "gated_backward": _silu_on_cuda(lambda act, h, g: _triton.silu_gated_backward(h, g), KERNELS["gated_backward"]),
    }


def _silu_on_cuda(gpu_fn: Callable, other_fn: Callable) -> Callable:
    # The gated activation's kernels (first argument: the activation function or its name) in triton for SwiGLU
    # on CUDA: one launch, where the compiled kernel's call costs several times the host time (it runs on the
    # forward's critical path, right after the split-size sync). Other activations keep ``other_fn``.
    def call(act, h_NX, *rest):
        silu = act is F.silu or (isinstance(act, str) and act == "silu")
        return (gpu_fn if silu and h_NX.is_cuda else other_fn)(act, h_NX, *rest)

    call.__wrapped__ = other_fn
    return call


def _on_cuda(gpu_fn: Callable, other_fn: Callable) -> Callable:
    def call(first, *args):
        return (gpu_fn if first.is_cuda else other_fn)(first, *args)

    call.__wrapped__ = other_fn
    return call


def compile_rows_dynamic(fn):
    """``torch.compile(fn)`` whose tensor arguments are dynamic in dim 0 (rows) only.

    The row count changes every step (tokens per expert); the feature sizes never do. Compiling with every dim
    symbolic (``dynamic=True``) made the kernels 3-5x slower than the memory bound (index arithmetic on symbolic
    widths, no vectorised loads), so only the rows are marked dynamic and the widths are compiled in.
    """
    compiled = torch.compile(fn)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    call.__wrapped__ = fn
    return call


def set_compiled_kernels(enabled: bool) -> None:
    """Use ``torch.compile``-fused pointwise kernels on the expert path (the gated activation; the weighted
    combine of the K copies, reading each copy once) or the eager ones. Same functions; a GPU speed option.
    With triton on a CUDA machine the gathers around the expert GEMM (token rows to expert order, the combine
    and both their backwards) and SwiGLU's gated activation both ways use the triton kernels of
    ``moeshard.ep._triton`` for CUDA tensors (``MOESHARD_TRITON_KERNELS=0`` keeps the compiled ones)."""
    for name in _EP_KERNELS:
        KERNELS[name] = compile_rows_dynamic(_EP_EAGER[name]) if enabled else _EP_EAGER[name]
    KERNELS["expand_rows"], KERNELS["combine_backward"] = _expand_rows, _combine_backward
    gpu = _triton_kernels() if enabled else None
    KERNELS.update(gpu or {})


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the T*K routed copies by expert, stably (ties keep token order).

    Returns:
        ``order_N``: flat copy indices (``t * K + k``) in expert order; the copy's token is ``order_N // K``.
        ``counts_E``: copies per expert (int64, on the ids' device), computed without a host sync.
    """
    ids_N = topk_ids_TK.reshape(-1)
    sorted_ids_N, order_N = torch.sort(ids_N, stable=True)
    # searchsorted gives each expert's first position in the sorted ids; bincount would sync on CUDA.
    bounds = torch.arange(num_experts + 1, device=ids_N.device, dtype=sorted_ids_N.dtype)
    counts_E = torch.diff(torch.searchsorted(sorted_ids_N, bounds)).to(torch.int64)
    return order_N, counts_E


def inverse_permutation(perm_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``, so ``a[perm][inv] == a``."""
    inv_N = torch.empty_like(perm_N)
    inv_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device, dtype=perm_N.dtype)
    return inv_N


def regroup_by_local_expert(recv_counts_PEl: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Permutation taking received rows from (source rank, local expert) order to (local expert, source rank).

    Args:
        recv_counts_PEl: ``[P, El]`` rows received from each rank for each local expert (device tensor).
        num_rows: the total ``R`` (known on the host; passing it spares repeat_interleave a sync).

    Returns:
        ``perm_R`` such that ``rows[perm_R]`` is grouped by local expert, source ranks in order within each.
    """
    P, El = recv_counts_PEl.shape
    expert_of_block = torch.arange(El, device=recv_counts_PEl.device).repeat(P)
    expert_of_row_R = torch.repeat_interleave(expert_of_block, recv_counts_PEl.reshape(-1), output_size=num_rows)
    return torch.sort(expert_of_row_R, stable=True)[1]


class _ExpandRows(torch.autograd.Function):
    """``x_TD[order_N // K]``: each token copied K times, in expert order; backward adds the K copies' grads."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(inv_N)
        ctx.K = K
        return KERNELS["expand_rows"](x_TD, order_N, K)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):  # noqa: D102
        (inv_N,) = ctx.saved_tensors
        # back to copy order t*K+k, then the K copies of token t are adjacent: a sum, no scatter.
        return KERNELS["gather_sum"](grad_ND.contiguous(), inv_N, ctx.K), None, None, None


class _SlotGather(torch.autograd.Function):
    """``x[slot // S]`` for unique slots of an ``[rows, S]`` grid; backward puts each gradient row in its slot
    (a plain copy, no atomics) and sums each row's S slots, instead of an atomic index_add."""

    @staticmethod
    def forward(ctx, x_RD: torch.Tensor, slot_N: torch.Tensor, S: int) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(slot_N)
        ctx.rows, ctx.S = x_RD.shape[0], S
        return x_RD.index_select(0, torch.div(slot_N, S, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):  # noqa: D102
        (slot_N,) = ctx.saved_tensors
        buf = grad_ND.new_zeros((ctx.rows * ctx.S, grad_ND.shape[-1])).index_copy_(0, slot_N, grad_ND)
        return buf.view(ctx.rows, ctx.S, grad_ND.shape[-1]).sum(dim=1), None, None


def _to_slots(y_ND: torch.Tensor, slot_N: torch.Tensor, rows: int, S: int) -> torch.Tensor:
    """``[rows, S, D]`` zeros with ``y_ND`` placed at the unique ``slot_N`` (differentiable: a gather back)."""
    buf = y_ND.new_zeros((rows * S, y_ND.shape[-1])).index_copy(0, slot_N, y_ND)
    return buf.view(rows, S, y_ND.shape[-1])


def combine(
    y_sorted_ND: torch.Tensor, order_N: torch.Tensor, topk_weights_TK: torch.Tensor, inv_N: torch.Tensor | None = None
) -> torch.Tensor:
    """Un-sort the expert outputs and add each token's K copies, weighted, in float32.

    Returns:
        ``y_TD`` in float32.
    """
    inv_N = inverse_permutation(order_N) if inv_N is None else inv_N
    return _Combine.apply(y_sorted_ND, topk_weights_TK, order_N, inv_N)


class _Combine(torch.autograd.Function):
    """``Σ_k w_tk · y_sorted[inv[t*K+k]]`` in float32, each direction one fused gather-and-arithmetic kernel
    (compiled kernels on) instead of a permutation gather followed by the weighted sum."""

    @staticmethod
    def forward(ctx, y_sorted_ND, w_TK, order_N, inv_N):  # noqa: D102
        ctx.save_for_backward(y_sorted_ND, w_TK, order_N, inv_N)
        return KERNELS["unsort_weighted_sum"](y_sorted_ND, inv_N, w_TK)

    @staticmethod
    def backward(ctx, g_TD):  # noqa: D102
        y_sorted_ND, w_TK, order_N, inv_N = ctx.saved_tensors
        need_gy, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gy, gw = KERNELS["combine_backward"](g_TD.contiguous(), y_sorted_ND, order_N, inv_N, w_TK, need_gy, need_gw)
        return gy, None if gw is None else gw.to(w_TK.dtype), None, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:  # noqa: D102
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: D102
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven ``all_to_all_single`` along dim 0 (send ``in_splits[r]`` rows to rank r)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w_gate_up_EXD: torch.Tensor,
    w_down_EDF: torch.Tensor,
    *,
    num_experts: int,
    ep_group: dist.ProcessGroup | None = None,
    activation: str = "silu",
    backend: Backend | None = None,
) -> torch.Tensor:
    """The routed-expert output of one MoE layer, ``y = Σ_k w_k · down_e(act(gate_e x) * up_e x)``.

    One code path for every EP size: with ``ep_group`` None (or of size 1) everything is local and no process
    group is needed. Global expert ``g`` lives on EP rank ``g // E_local`` as local expert ``g % E_local``.
    Forward makes exactly one device→host sync when EP size > 1 (the split sizes), zero or one otherwise
    (none with the grouped_mm backend, the loop backend's counts otherwise); backward makes none.

    Args:
        x_TD: this rank's tokens ``[T, D]`` (T may be 0).
        topk_ids_TK: global expert ids ``[T, K]``.
        topk_weights_TK: routing weights ``[T, K]``, applied in float32.
        w_gate_up_EXD: local experts' ``[E_local, 2F, D]`` (gate rows first, then up).
        w_down_EDF: local experts' ``[E_local, D, F]``.
        num_experts: the global number of experts, ``E_local * ep_size``.
        ep_group: the EP process group (``ep_group(experts_module)``), or None.
        activation: the gated activation (see :func:`grouped_expert_mlp`).
        backend: expert-GEMM backend, None for the process default (see :func:`grouped_expert_mlp`).

    Returns:
        ``y_TD`` in x's dtype.
    """
    _activation(activation)
    if x_TD.dim() != 2 or topk_ids_TK.dim() != 2 or topk_ids_TK.shape != topk_weights_TK.shape:
        raise ValueError(
            f"routed_experts takes x [T, D], topk_ids [T, K] and topk_weights [T, K], got "
            f"{tuple(x_TD.shape)}, {tuple(topk_ids_TK.shape)}, {tuple(topk_weights_TK.shape)}"
        )
    if topk_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids_TK.shape[0]} rows for {x_TD.shape[0]} tokens")
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids_TK.dtype}")
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    E_local = w_gate_up_EXD.shape[0]
    if E_local * ep_size != num_experts:
        raise ValueError(
            f"num_experts={num_experts} but the EP group of {ep_size} ranks holds {E_local} experts each "
            f"({E_local * ep_size} in all); pass the weights after apply_ep and the model's global expert count"
        )
    if ep_size > 1 and _dispatch[0] == "tokens":
        y_TD = _ep_routed(
            x_TD, topk_ids_TK, topk_weights_TK, w_gate_up_EXD, w_down_EDF, ep_size, ep_group, activation, backend
        )
        return y_TD.to(x_TD.dtype)
    K = topk_ids_TK.shape[1]
    order_N, counts_E = sort_by_expert(topk_ids_TK, num_experts)
    inv_N = inverse_permutation(order_N)
    x_sorted_ND = _ExpandRows.apply(x_TD, order_N, inv_N, K)
    if ep_size == 1:
        y_sorted_ND = grouped_expert_mlp(
            x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, activation=activation, backend=backend
        )
    else:
        y_sorted_ND = _copies_routed(
            x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, ep_size, ep_group, activation, backend
        )
    return combine(y_sorted_ND, order_N, topk_weights_TK, inv_N).to(x_TD.dtype)


def _ep_routed(x_TD, ids_TK, w_TK, w_gate_up_EXD, w_down_EDF, P, group, activation, backend):
    T, K = ids_TK.shape
    El = w_gate_up_EXD.shape[0]
    dev = x_TD.device
    dest_TK = torch.div(ids_TK, El, rounding_mode="floor")
    ranks_P = torch.arange(P, device=dev)
    hit_PT = (dest_TK.unsqueeze(0) == ranks_P[:, None, None]).any(dim=-1)  # token t goes to rank r
    copies_E = torch.zeros(P * El, dtype=torch.int64, device=dev)
    copies_E.scatter_add_(0, ids_TK.reshape(-1), torch.ones_like(ids_TK.reshape(-1)))  # no sync (unlike bincount)
    send_meta_PM = torch.cat([hit_PT.sum(dim=1, dtype=torch.int64)[:, None], copies_E.view(P, El)], dim=1)
    recv_meta_PM = torch.empty_like(send_meta_PM)
    dist.all_to_all_single(recv_meta_PM, send_meta_PM, group=group)
    # The one device→host sync of the layer: all-to-all split sizes must be host ints. Sent and received counts
    # come in one .tolist() so there is a single sync, not two.
    _before_host_sync()
    host = torch.cat([send_meta_PM[:, 0], recv_meta_PM.reshape(-1)]).tolist()
    in_splits = host[:P]
    recv = host[P:]
    out_splits = [recv[r * (El + 1)] for r in range(P)]
    local_counts = [sum(recv[r * (El + 1) + 1 + e] for r in range(P)) for e in range(El)]
    n_send, n_copies = sum(in_splits), sum(local_counts)

    # Sender: (rank, token) pairs in rank order, tokens in order within a rank.
    pair_S = torch.sort(torch.where(hit_PT.reshape(-1), torch.arange(P * T, device=dev), P * T))[0][:n_send]
    tok_S = pair_S % T
    dest_S = torch.div(pair_S, T, rounding_mode="floor")
    mine_SK = dest_TK.index_select(0, tok_S) == dest_S[:, None]  # copies of this token on that rank
    ids_SK = torch.where(mine_SK, ids_TK.index_select(0, tok_S) % El, El)  # El: not on that rank
    w_SK = torch.where(mine_SK, w_TK.index_select(0, tok_S), torch.zeros((), dtype=w_TK.dtype, device=dev))
    slot_S = tok_S * P + dest_S  # token t's copy for rank r sits in slot (t, r) of a [T, P] grid
    x_RD = all_to_all(_SlotGather.apply(x_TD, slot_S, P), out_splits, in_splits, group)
    # Ids and weights travel together in one float32 exchange (ids < 2**24 are exact; so are bf16 weights).
    meta_RK2 = all_to_all(torch.cat([ids_SK.float(), w_SK.float()], dim=1), out_splits, in_splits, group)
    ids_RK, w_RK = meta_RK2[:, :K].long(), meta_RK2[:, K:]

    # Receiver: copies grouped by local expert ("not here" sorts last and is cut off), one grouped GEMM; a copy
    # of received token i for its k-th expert is slot (i, k) of an [R, K] grid.
    R = x_RD.shape[0]
    order_C = sort_by_expert(ids_RK, El + 1)[0][:n_copies]
    y_CD = grouped_expert_mlp(
        _SlotGather.apply(x_RD, order_C, K),
        recv_meta_PM[:, 1:].sum(dim=0),
        w_gate_up_EXD,
        w_down_EDF,
        host_counts=local_counts,
        activation=activation,
        backend=backend,
    )
    # Each received token's copies weighted and added in float32 (empty slots hold zeros and weight 0).
    y_RD = KERNELS["weighted_sum"](_to_slots(y_CD, order_C, R, K), w_RK)
    # Partial outputs (one per received token) go home and are added per token, in float32.
    y_SD = all_to_all(y_RD.to(x_TD.dtype), in_splits, out_splits, group)
    return _to_slots(y_SD, slot_S, T, P).sum(dim=1, dtype=torch.float32)


def _copies_routed(x_sorted_ND, counts_E, w_gate_up_EXD, w_down_EDF, P, group, activation, backend):
    # Every routed copy travels (no de-duplication): more bytes, fewer and simpler collectives.
    El = w_gate_up_EXD.shape[0]
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)  # El counts to and from each rank
    # Everything the device can prepare without the split sizes is queued before the sync (the three expert
    # passes' row counts and GEMM offsets): after it the device idles until the host launches again, so the
    # host work left there is what delays the layer.
    me = dist.get_rank(group)
    others = [r for r in range(P) if r != me]
    local_E = counts_E.view(P, El)[me]
    recv_PEl = recv_counts_E.view(P, El)
    if P == 2:  # one source: its rows already come grouped by local expert
        remote_E, rest_OEl = recv_PEl[others[0]], None
    else:
        rest_OEl = recv_PEl[torch.tensor(others, device=recv_PEl.device)]
        remote_E = rest_OEl.sum(0)
    half = El // 2
    device_counts = (local_E[:half], remote_E, local_E[half:])
    offsets = tuple(torch.cumsum(c, 0, dtype=torch.int32) for c in device_counts)
    # The one device→host sync of the layer: the exchange sizes must be host ints. Both count tensors go in
    # one .tolist() so there is a single sync, not two.
    _before_host_sync()
    host = torch.cat([counts_E, recv_counts_E]).tolist()
    send_counts, recv_counts = host[: P * El], host[P * El :]
    ex = _Exchange(group, P, El, send_counts, recv_counts, rest_OEl, device_counts, offsets, activation, backend)
    return _OverlappedExperts.apply(x_sorted_ND, w_gate_up_EXD, w_down_EDF, ex)


class _Exchange:
    """Host-side layout of one layer's copies exchange (from the split sizes) and the device counts.

    ``send``: ``(peer, first row, rows)`` of the sorted copies going to each other rank; ``recv``: the same for
    the buffer of copies received from the other ranks (source-rank order, each source's rows grouped by local
    expert); ``local``: this rank's own copies, which never travel.
    """

    def __init__(self, group, P, El, send_counts, recv_counts, rest_OEl, device_counts, offsets, activation, backend):
        self.group, self.activation, self.backend = group, activation, backend
        # (half A of the own copies, the received copies, half B): device counts and int32 GEMM offsets
        self.device_counts, self.offsets = device_counts, offsets
        me = dist.get_rank(group)
        send = [sum(send_counts[r * El : (r + 1) * El]) for r in range(P)]
        recv = [sum(recv_counts[r * El : (r + 1) * El]) for r in range(P)]
        starts = [sum(send[:r]) for r in range(P)]
        self.local = (starts[me], send[me])
        self.send = [(dist.get_global_rank(group, r), starts[r], send[r]) for r in range(P) if r != me]
        others = [r for r in range(P) if r != me]
        rstarts = [sum(recv[o] for o in others[:i]) for i in range(len(others))]
        self.recv = [(dist.get_global_rank(group, r), s, recv[r]) for r, s in zip(others, rstarts)]
        self.rows_in = sum(recv[r] for r in others)
        self.local_host = send_counts[me * El : (me + 1) * El]
        if len(others) == 1:
            self.remote_host, self.perm = recv_counts[others[0] * El : (others[0] + 1) * El], None
        else:
            self.remote_host = [sum(recv_counts[r * El + e] for r in others) for e in range(El)]
            perm = regroup_by_local_expert(rest_OEl, self.rows_in)
            self.perm = (perm, inverse_permutation(perm))

    def start(self, src: torch.Tensor, src_slices, dst: torch.Tensor, dst_slices) -> list:
        """Post the sends of ``src``'s slices and the receives into ``dst``'s slices; returns the works."""
        ops = [dist.P2POp(dist.isend, src[s : s + n], peer, self.group) for peer, s, n in src_slices if n]
        ops += [dist.P2POp(dist.irecv, dst[s : s + n], peer, self.group) for peer, s, n in dst_slices if n]
        return dist.batch_isend_irecv(ops) if ops else []


# the SMs NCCL's send/recv kernel occupies on 2 H200s (its grid); MOESHARD_EP_SM_CARVEOUT overrides (0: off)
_SM_CARVEOUT = [int(os.environ.get("MOESHARD_EP_SM_CARVEOUT", "32"))]


class _carveout:
    """Leave SMs free for the communication kernel while a GEMM overlaps it: the grouped GEMM (and cuBLAS)
    otherwise sizes its persistent grid to every SM and the exchange waits for the GEMM to finish."""

    def __init__(self, device: torch.device, busy: bool):
        self.on = busy and device.type == "cuda" and _SM_CARVEOUT[0] > 0
        self.before = None

    def __enter__(self):
        if self.on:
            self.before = torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(_SM_CARVEOUT[0])

    def __exit__(self, *exc):
        if self.on:
            torch._C._set_sm_carveout_experimental(self.before)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class _LocalHalf:
    """A contiguous range of local experts and their rows among this rank's own (never travelling) copies."""

    def __init__(self, ex: _Exchange, first: int, last: int, which: int, backend: str):
        lo, _ = ex.local
        counts = ex.local_host
        self.experts = slice(first, last)
        self.rows = slice(lo + sum(counts[:first]), lo + sum(counts[:last]))
        self.run = ExpertPass(
            ex.device_counts[which], counts[first:last], ex.activation, backend, offsets=ex.offsets[which]
        )


def _add_slice(full, part, sl):
    if part is not None and full is not None:
        full[sl].add_(part)


class _OverlappedExperts(torch.autograd.Function):
    """The copies' trip through the experts of their EP ranks, with both exchanges overlapped by local work.

    A rank's own copies (those routed to its own experts) never travel. Their experts are split in two halves,
    A and B. Forward: post the sends of the copies bound for other ranks and run half A of the own copies
    meanwhile; run the received copies; post their outputs home and run half B meanwhile. Backward mirrors it:
    the output gradients of remote copies travel during half A's backward, the input gradients go home during
    half B's. The three expert passes have hand-written backwards (:class:`ExpertPass`) whose inputs are saved
    with ``save_for_backward``, so activation checkpointing recomputes the layer once, as for any op; each half
    works on its slice of the weights and its weight gradients are added into the slices of the remote pass's.
    With 2 EP ranks the received rows need no regrouping (one source, already grouped by local expert), so the
    plain path's two permutation gathers each way disappear.
    """

    @staticmethod
    def forward(ctx, x_sorted_ND, w_gate_up_EXD, w_down_EDF, ex: _Exchange):  # noqa: D102
        N, D = x_sorted_ND.shape
        El = w_gate_up_EXD.shape[0]
        backend = _resolve_backend(ex.backend, x_sorted_ND, w_gate_up_EXD)
        half_a, half_b = _LocalHalf(ex, 0, El // 2, 0, backend), _LocalHalf(ex, El // 2, El, 2, backend)
        remote = ExpertPass(ex.device_counts[1], ex.remote_host, ex.activation, backend, offsets=ex.offsets[1])
        dev = x_sorted_ND.device

        def local(part):
            if part.experts.start == part.experts.stop:
                return None, ()
            sl = part.experts
            return part.run.forward(x_sorted_ND[part.rows], w_gate_up_EXD[sl], w_down_EDF[sl])

        recv_MD = x_sorted_ND.new_empty((ex.rows_in, D))
        works = ex.start(x_sorted_ND, ex.send, recv_MD, ex.recv)
        with _carveout(dev, bool(works)):
            y_a, saved_a = local(half_a)
        _wait(works)
        x_in = recv_MD if ex.perm is None else recv_MD.index_select(0, ex.perm[0])
        y_rem, saved_r = remote.forward(x_in, w_gate_up_EXD, w_down_EDF)
        if ex.perm is not None:
            y_rem = y_rem.index_select(0, ex.perm[1])
        y_sorted_ND = x_sorted_ND.new_empty((N, D))
        works = ex.start(y_rem, ex.recv, y_sorted_ND, ex.send)
        with _carveout(dev, bool(works)):
            y_b, saved_b = local(half_b)
        for part, y in ((half_a, y_a), (half_b, y_b)):
            if y is not None:
                y_sorted_ND[part.rows].copy_(y)
        _wait(works)
        ctx.ex, ctx.passes = ex, (half_a, remote, half_b)
        ctx.sizes = (len(saved_a), len(saved_r), len(saved_b))
        ctx.save_for_backward(w_gate_up_EXD, w_down_EDF, *saved_a, *saved_r, *saved_b)
        return y_sorted_ND

    @staticmethod
    def backward(ctx, grad_ND):  # noqa: D102
        ex = ctx.ex
        half_a, remote, half_b = ctx.passes
        w1, w2, *saved = ctx.saved_tensors
        na, nr, _ = ctx.sizes
        saved_a, saved_r, saved_b = saved[:na], saved[na : na + nr], saved[na + nr :]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_ND = grad_ND.contiguous()
        N, D = grad_ND.shape
        dev = grad_ND.device

        def local(part, saved_part):
            if not saved_part:
                return None, None, None
            sl = part.experts
            return part.run.backward(grad_ND[part.rows], saved_part, w1[sl], w2[sl], need_x, need_w)

        grad_in_MD = grad_ND.new_empty((ex.rows_in, D))
        works = ex.start(grad_ND, ex.send, grad_in_MD, ex.recv)
        with _carveout(dev, bool(works)):
            gx_a, gw1_a, gw2_a = local(half_a, saved_a)
        _wait(works)
        g_rem = grad_in_MD if ex.perm is None else grad_in_MD.index_select(0, ex.perm[0])
        gx_rem, gw1, gw2 = remote.backward(g_rem, saved_r, w1, w2, need_x, need_w)
        gx = None
        works = []
        if need_x:
            if ex.perm is not None:
                gx_rem = gx_rem.index_select(0, ex.perm[1])
            gx = grad_ND.new_empty((N, D))
            works = ex.start(gx_rem, ex.recv, gx, ex.send)
        with _carveout(dev, bool(works)):
            gx_b, gw1_b, gw2_b = local(half_b, saved_b)
        if gx is not None:
            for part, g in ((half_a, gx_a), (half_b, gx_b)):
                if g is not None:
                    gx[part.rows].copy_(g)
        for part, g1, g2 in ((half_a, gw1_a, gw2_a), (half_b, gw1_b, gw2_b)):
            _add_slice(gw1, g1, part.experts)
            _add_slice(gw2, g2, part.experts)
        _wait(works)
        return (
            gx,
            gw1 if ctx.needs_input_grad[1] else None,
            gw2 if ctx.needs_input_grad[2] else None,
            None,
        )
