"""The pointwise and gather kernels around the expert GEMMs, as one immutable object per tier.

# T tokens, K top-k, D hidden, N = T*K routed copies in expert order (copy n is token order[n] // K's copy;
# inv[t*K+k] is the row of token t's k-th copy), F expert width, X = 2F (gate rows, then up rows)

:func:`kernels_for` returns the :class:`Kernels` of a tier, built once per process and never changed:

- ``"eager"``: the torch functions below;
- ``"compiled"``: the same functions through :func:`compile_rows_dynamic` (the gated activation both ways, plain
  and weighted by the routing weights, the copies' sum); the row expansion stays an eager gather;
- ``"triton"``: on CUDA tensors the triton kernels of ``moeshard.ep._triton`` (the gathers, SwiGLU's gated
  activation both ways, plain and weighted), ``moeshard.ep._wgrad_triton`` (the weight gradients added into the
  gradient inside the grouped GEMM) and ``moeshard.ep._route_triton`` (the route as a counting sort), the compiled
  functions for everything else (CPU tensors, other activations).

All tiers compute the same thing (products and sums of the routing weights in float32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moeshard.ep._options import GEMMS, KERNEL_TIERS
from moeshard.ep._sort import inverse_permutation, sort_by_expert
from moeshard.ep._squares import read_squares
from moeshard.ep._torch_internals import mark_rows_dynamic

__all__ = [
    "ACTIVATIONS",
    "ClampedSwiGLU",
    "Kernels",
    "activation_fn",
    "compile_rows_dynamic",
    "kernels_for",
    "resolve_gemm",
]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
"""Activation name -> function, for the ``activation=`` argument of the expert MLP (gated as ``act(gate) * up``)."""


@dataclass(frozen=True)
class ClampedSwiGLU:
    """A clamped, offset SwiGLU, an ``activation=`` of the expert MLP beside the names of :data:`ACTIVATIONS`:
    ``(clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``, on ``h = [gate | up]``
    (gate rows first, as every expert weight here; the Hub's interleaved rows are reordered on load).

    Every kernel tier runs it (the triton tier through its compiled kernels: its own kernels are SwiGLU's), forward
    and backward; the backward is written out (the clamps pass the gradient inside their range, as autograd's)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if not (self.limit > 0 and self.alpha > 0):
            raise ValueError(f"ClampedSwiGLU needs alpha > 0 and limit > 0, got alpha={self.alpha} limit={self.limit}")

    def parts(self, gate_NF: torch.Tensor, up_NF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(act, up + 1)``: the gate's activation and the clamped up factor, whose product is the output."""
        g_NF = gate_NF.clamp(max=self.limit)
        return g_NF * torch.sigmoid(g_NF * self.alpha), up_NF.clamp(-self.limit, self.limit) + 1

    def grads(self, gate_NF: torch.Tensor, up_NF: torch.Tensor, grad_NF: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(d gate, d up, act, up + 1)`` for the output's gradient ``grad_NF``."""
        act_NF, up1_NF = self.parts(gate_NF, up_NF)
        g_NF = gate_NF.clamp(max=self.limit)
        sig_NF = torch.sigmoid(g_NF * self.alpha)
        d_act = sig_NF + g_NF * self.alpha * sig_NF * (1 - sig_NF)
        d_gate = torch.where(gate_NF <= self.limit, grad_NF * up1_NF * d_act, 0.0)
        d_up = torch.where(up_NF.abs() <= self.limit, grad_NF * act_NF, 0.0)
        return d_gate, d_up, act_NF, up1_NF


Activation = str | ClampedSwiGLU
"""What the expert MLP's ``activation=`` takes: a name of :data:`ACTIVATIONS` (``act(gate) * up``) or a spec."""


def activation_fn(name: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of activation ``name`` (a spec: its gate activation); ValueError naming the supported ones
    otherwise."""
    if isinstance(name, ClampedSwiGLU):
        return lambda gate: name.parts(gate, gate)[0]
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}") from None


# ---- eager functions --------------------------------------------------------------------------------------------


def gated(activation: Activation, h_NX: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` for ``h = [gate | up]``."""
    gate_NF, up_NF = h_NX.chunk(2, dim=-1)
    if isinstance(activation, ClampedSwiGLU):
        act_NF, up1_NF = activation.parts(gate_NF, up_NF)
        return act_NF * up1_NF
    return ACTIVATIONS[activation](gate_NF) * up_NF


def gated_backward(activation: Activation, h_NX: torch.Tensor, grad_NF: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`gated` w.r.t. ``h = [gate | up]``: the same ops autograd runs for it."""
    gate_NF, up_NF = h_NX.chunk(2, dim=-1)
    if isinstance(activation, ClampedSwiGLU):
        return torch.cat(activation.grads(gate_NF, up_NF, grad_NF)[:2], dim=-1)
    if activation == "silu":
        d_gate = torch.ops.aten.silu_backward(grad_NF * up_NF, gate_NF)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        d_gate = torch.ops.aten.gelu_backward(grad_NF * up_NF, gate_NF, approximate=approximate)
    return torch.cat([d_gate, grad_NF * ACTIVATIONS[activation](gate_NF)], dim=-1)


def weighted_gated(activation: Activation, h_NX: torch.Tensor, s_N: torch.Tensor) -> torch.Tensor:
    """``s · act(gate) · up`` for ``h = [gate | up]`` and a float32 weight per row: the routing weight applied to
    the expert's activation, before its down projection (float32 arithmetic, rounded once to h's dtype)."""
    gate_NF, up_NF = h_NX.float().chunk(2, dim=-1)
    if isinstance(activation, ClampedSwiGLU):
        act_NF, up1_NF = activation.parts(gate_NF, up_NF)
        return (act_NF * up1_NF * s_N.float().unsqueeze(-1)).to(h_NX.dtype)
    return (ACTIVATIONS[activation](gate_NF) * up_NF * s_N.float().unsqueeze(-1)).to(h_NX.dtype)


def weighted_gated_backward(
    activation: Activation, h_NX: torch.Tensor, grad_NF: torch.Tensor, s_N: torch.Tensor, need_a: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(grad h, grad s, a | None)`` of :func:`weighted_gated`: ``grad s[n] = Σ_f grad[n, f] · act(gate) · up``
    (float32), ``grad h`` the gated activation's gradient at ``s · grad`` (h's dtype), and with ``need_a`` the
    forward's output again (for a caller that did not keep it). Float32 arithmetic throughout."""
    gate_NF, up_NF = h_NX.float().chunk(2, dim=-1)
    g_NF, s_N1 = grad_NF.float(), s_N.float().unsqueeze(-1)
    if isinstance(activation, ClampedSwiGLU):
        d_gate, d_up, act_NF, up1_NF = activation.grads(gate_NF, up_NF, g_NF * s_N1)
        gated_NF = act_NF * up1_NF
        a_NF = (gated_NF * s_N1).to(h_NX.dtype) if need_a else None
        return torch.cat([d_gate, d_up], dim=-1).to(h_NX.dtype), (g_NF * gated_NF).sum(dim=-1), a_NF
    act_NF = ACTIVATIONS[activation](gate_NF)
    gated_NF = act_NF * up_NF
    gs_NF = g_NF * s_N1
    if activation == "silu":
        d_gate = torch.ops.aten.silu_backward(gs_NF * up_NF, gate_NF)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        d_gate = torch.ops.aten.gelu_backward(gs_NF * up_NF, gate_NF, approximate=approximate)
    grad_h = torch.cat([d_gate, gs_NF * act_NF], dim=-1).to(h_NX.dtype)
    a_NF = (gated_NF * s_N1).to(h_NX.dtype) if need_a else None
    return grad_h, (g_NF * gated_NF).sum(dim=-1), a_NF


def expand_rows(x_TD: torch.Tensor, order_N: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """``x[order // K]``: each token's row once per routed copy, in expert order (``inv_N``, the inverse of
    ``order_N``, is for the tiers that write token by token)."""
    return x_TD.index_select(0, torch.div(order_N, K, rounding_mode="floor"))


def gather_sum(grad_ND: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """``Σ_k grad[inv[t*K+k]]``: back to copy order, then each token's K adjacent copies summed."""
    return grad_ND.index_select(0, inv_N).view(-1, K, grad_ND.shape[-1]).sum(dim=1)


def weight_grad_into(a_NM: torch.Tensor, b_NK: torch.Tensor, offs_E: torch.Tensor, out_EMK: torch.Tensor) -> None:
    """``out[e] += a[rows_e]^T @ b[rows_e]`` for each expert (``offs_E``: int32 cumulative row ends): the
    ``grouped_mm`` into a new tensor, then one add (the pass ``moeshard.ep._wgrad_triton`` folds into the GEMM)."""
    out_EMK.add_(F.grouped_mm(a_NM.transpose(0, 1), b_NK, offs=offs_E))


def weight_grad_sum(parts: list, out_EMK: torch.Tensor, accumulate: bool, squares: torch.Tensor | None = None) -> None:
    """``out[e] (+)= Σ_p a_p[rows_e]^T @ b_p[rows_e]`` over parts ``(a_NM, b_NK, offs_E)`` (``offs_E``: int32
    cumulative row ends): each part's ``grouped_mm`` added in turn on CUDA, elsewhere one matmul per expert and part
    (the offsets read on the host). ``squares`` (a one-element float32 tensor, or None) receives ``Σ out²`` after
    (here by reading ``out`` once more)."""
    if not accumulate:
        out_EMK.zero_()
    for a_NM, b_NK, offs_E in parts:
        if a_NM.is_cuda:
            weight_grad_into(a_NM, b_NK, offs_E, out_EMK)
            continue
        start = 0
        for e, end in enumerate(offs_E.tolist()):
            if end > start:
                out_EMK[e].add_(a_NM[start:end].transpose(0, 1) @ b_NK[start:end])
            start = end
    if squares is not None:
        read_squares(out_EMK, squares)


def route(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order_N, inv_N, counts_E)``: the copies in expert order (stable), its inverse and the copies per expert,
    by ``torch.sort`` (``moeshard.ep._sort``'s :func:`sort_by_expert` and :func:`inverse_permutation`)."""
    order_N, counts_E = sort_by_expert(topk_ids_TK, num_experts)
    return order_N, inverse_permutation(order_N), counts_E


def compile_rows_dynamic(fn: Callable) -> Callable:
    """``torch.compile(fn)`` whose tensor arguments are dynamic in dim 0 (rows) only.

    The row count changes every step (tokens per expert); the feature sizes never do. Compiling with every dim
    symbolic (``dynamic=True``) makes the kernels index through symbolic widths without vectorised loads, so
    only the rows are marked dynamic and the widths are compiled in. Non-tensor arguments pass through (and
    are guarded on by ``torch.compile`` as usual). Compilation happens at the first call.
    """
    compiled = torch.compile(fn)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                mark_rows_dynamic(a)
        return compiled(*args)

    call.__wrapped__ = fn
    return call


# ---- the tiers --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """The kernel functions of one tier (see the module docstring); same signatures in every tier.

    Attributes:
        tier: ``"eager"``, ``"compiled"`` or ``"triton"``.
        gated: ``(activation, h_NX) -> a_NF``.
        gated_backward: ``(activation, h_NX, grad_NF) -> grad_NX``.
        expand_rows: ``(x_TD, order_N, inv_N, K) -> x_sorted_ND``.
        gather_sum: ``(grad_ND, inv_N, K) -> grad_TD`` (the backward of ``expand_rows``).
        weighted_gated: ``(activation, h_NX, s_N) -> a_NF``, the gated activation times each row's routing weight.
        weighted_gated_backward: ``(activation, h_NX, grad_NF, s_N, need_a) -> (grad_NX, grad_s_N, a_NF | None)``
            (``grad_s`` in float32; ``a``, the forward's output again, only with ``need_a``).
        weight_grad_into: ``(a_NM, b_NK, offs_E, out_EMK) -> None``, ``out[e] += a[rows_e]^T @ b[rows_e]`` (the
            grouped_mm backend's weight gradients added into a gradient buffer, see ``ExpertPass.backward``).
        weight_grad_sum: ``(parts, out_EMK, accumulate, squares=None) -> None``, ``out[e] (+)= Σ_p a_p[rows_e]^T @
            b_p[rows_e]`` over parts ``(a_NM, b_NK, offs_E)``: kept weight-gradient factors formed (see
            ``sum_weight_grads``); ``squares`` (a one-element float32 tensor) receives ``Σ out²`` after, from the
            triton kernel's epilogue on CUDA (no second read of the gradient).
        route: ``(topk_ids_TK, num_experts) -> (order_N, inv_N, counts_E)``, the copies in expert order (stable),
            its inverse and the copies per expert (int64, no host sync): by sort, or the triton counting sort.
        sums_parts: ``(a_NM) -> bool``, whether ``weight_grad_sum`` forms several parts in one pass over the
            gradient for rows like ``a_NM`` (the triton tier on CUDA), so that a backward with several passes per
            weight (the overlapped dispatcher's) gains by handing it all of them instead of forming each pass's
            gradient and adding them.
    """

    tier: str
    gated: Callable
    gated_backward: Callable
    expand_rows: Callable
    gather_sum: Callable
    weighted_gated: Callable
    weighted_gated_backward: Callable
    weight_grad_into: Callable = weight_grad_into
    weight_grad_sum: Callable = weight_grad_sum
    route: Callable = route
    sums_parts: Callable = lambda a_NM: False  # noqa: E731


@functools.cache
def kernels_for(tier: str) -> Kernels:
    """The :class:`Kernels` of ``tier``, built at the first call and shared by every caller afterwards.

    Raises:
        ValueError: an unknown tier.
        ImportError: ``"triton"`` on a machine with CUDA where triton cannot be imported.
    """
    if tier not in KERNEL_TIERS:
        raise ValueError(f"kernel tier {tier!r} is not one of {KERNEL_TIERS}")
    if tier == "eager":
        return Kernels(
            tier=tier,
            gated=gated,
            gated_backward=gated_backward,
            expand_rows=expand_rows,
            gather_sum=gather_sum,
            weighted_gated=weighted_gated,
            weighted_gated_backward=weighted_gated_backward,
        )
    if tier == "compiled":
        return Kernels(
            tier=tier,
            gated=compile_rows_dynamic(gated),
            gated_backward=compile_rows_dynamic(gated_backward),
            expand_rows=expand_rows,  # one gather: nothing to fuse
            gather_sum=compile_rows_dynamic(gather_sum),
            weighted_gated=compile_rows_dynamic(weighted_gated),
            weighted_gated_backward=compile_rows_dynamic(weighted_gated_backward),
        )
    compiled = kernels_for("compiled")
    if not torch.cuda.is_available():  # no CUDA tensors: the compiled kernels throughout
        return replace(compiled, tier=tier)
    return _triton_kernels(compiled)


def _triton_kernels(other: Kernels) -> Kernels:
    try:
        from moeshard.ep import _route_triton, _triton
    except ImportError as e:
        raise ImportError(f"EPOptions(kernels='triton') needs triton on a machine with CUDA: {e}") from e

    def route_on_gpu(topk_ids_TK, num_experts):
        return (_route_triton.route if num_experts <= _route_triton.MAX_EXPERTS else route)(topk_ids_TK, num_experts)

    return Kernels(
        tier="triton",
        # one launch where the compiled kernel's call costs several times the host time (it runs on the
        # forward's critical path, right after the split-size sync); other activations keep the compiled one
        gated=_silu_on_cuda(lambda activation, h: _triton.gated(h), other.gated),
        gated_backward=_silu_on_cuda(lambda activation, h, g: _triton.silu_gated_backward(h, g), other.gated_backward),
        expand_rows=_on_cuda(_triton.expand_rows, other.expand_rows),
        gather_sum=_on_cuda(_triton.gather_sum, other.gather_sum),
        weighted_gated=_silu_on_cuda(lambda activation, h, s: _triton.silu_weighted_gated(h, s), other.weighted_gated),
        weighted_gated_backward=_silu_on_cuda(
            lambda activation, h, g, s, need_a: _triton.silu_weighted_gated_backward(h, g, s, need_a),
            other.weighted_gated_backward,
        ),
        weight_grad_into=_on_cuda(_wgrad_into_triton, other.weight_grad_into),
        weight_grad_sum=_wgrad_sum_on_cuda(other.weight_grad_sum),
        route=_on_cuda(route_on_gpu, other.route),
        sums_parts=lambda a_NM: a_NM.is_cuda,
    )


def _wgrad_into_triton(a_NM, b_NK, offs_E, out_EMK) -> None:
    from moeshard.ep._wgrad_triton import grouped_weight_grad

    if a_NM.stride(-1) != 1 or b_NK.stride(-1) != 1 or not out_EMK.is_contiguous():
        weight_grad_into(a_NM, b_NK, offs_E, out_EMK)  # layouts the kernel does not take (not the expert MLP's)
        return
    grouped_weight_grad(a_NM, b_NK, offs_E, out_EMK, accumulate=True)


def _wgrad_sum_on_cuda(other_fn: Callable) -> Callable:
    # The parts in one grouped GEMM (moeshard.ep._wgrad_triton) where all are row-major CUDA tensors.
    def call(parts, out_EMK, accumulate, squares=None):
        ok = out_EMK.is_cuda and out_EMK.is_contiguous()
        ok = ok and all(a.is_cuda and a.stride(-1) == 1 and b.stride(-1) == 1 for a, b, _ in parts)
        if not ok:
            return other_fn(parts, out_EMK, accumulate, squares)
        from moeshard.ep._wgrad_triton import grouped_weight_grad_parts

        grouped_weight_grad_parts(parts, out_EMK, accumulate=accumulate, squares=squares)

    call.__wrapped__ = other_fn
    return call


def _silu_on_cuda(gpu_fn: Callable, other_fn: Callable) -> Callable:
    # The gated activation's kernels (first argument: the activation's name) in triton for SwiGLU on CUDA.
    def call(activation, h_NX, *rest):
        return (gpu_fn if activation == "silu" and h_NX.is_cuda else other_fn)(activation, h_NX, *rest)

    call.__wrapped__ = other_fn
    return call


def _on_cuda(gpu_fn: Callable, other_fn: Callable) -> Callable:
    def call(first, *args):
        return (gpu_fn if first.is_cuda else other_fn)(first, *args)

    call.__wrapped__ = other_fn
    return call


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def resolve_gemm(gemm: str, x: torch.Tensor, w: torch.Tensor) -> str:
    """``"grouped_mm"`` or ``"loop"``: ``gemm`` itself, or what ``"auto"`` picks for these tensors."""
    if gemm not in GEMMS:
        raise ValueError(f"expert gemm {gemm!r} is not one of {GEMMS}")
    if gemm != "auto":
        return gemm
    ok = (
        x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and hasattr(F, "grouped_mm")
        and _capability(x.device) >= (9, 0)
    )
    return "grouped_mm" if ok else "loop"
