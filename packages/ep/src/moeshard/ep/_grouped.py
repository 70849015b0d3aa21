"""The local experts as one grouped GEMM over token rows grouped by expert (SwiGLU MLP).

# T tokens, K top-k, D hidden, E experts (local), F expert width, N routed copies (rows grouped by expert)

Two implementations that agree within dtype tolerance:

- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` with int32 cumulative row offsets; no host sync.
- ``"loop"``: one pair of matmuls per expert; needs the per-expert counts on the host (one ``.tolist()``
  unless the caller already has them) and runs on any device and dtype.

``"auto"`` (the default) picks ``grouped_mm`` on CUDA for bf16/fp16 on compute capability >= 9.0 (where it is
fast and tested), the loop elsewhere (on CPU, torch's grouped_mm needs 16-byte aligned strides and has no
float64). Override per call with ``backend=`` or for the process with :func:`set_grouped_mm_backend`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "ACTIVATIONS",
    "Backend",
    "get_grouped_mm_backend",
    "grouped_expert_mlp",
    "set_grouped_mm_backend",
]

Backend = Literal["auto", "grouped_mm", "loop"]
"""Expert-GEMM backends: ``grouped_mm`` (one kernel), ``loop`` (two matmuls per expert), ``auto`` (by device)."""
_BACKENDS = ("auto", "grouped_mm", "loop")
_backend: Backend = "auto"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
"""Activation name -> function, for the ``activation=`` argument of the expert MLP (gated as ``act(gate) * up``)."""


def set_grouped_mm_backend(backend: Backend) -> None:
    """Set the process-wide default expert-GEMM backend: ``"auto"``, ``"grouped_mm"`` or ``"loop"``."""
    global _backend
    if backend not in _BACKENDS:
        raise ValueError(f"grouped-mm backend must be one of {_BACKENDS}, got {backend!r}")
    _backend = backend


def get_grouped_mm_backend() -> Backend:
    """The process-wide default expert-GEMM backend."""
    return _backend


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _resolve_backend(backend: Backend | None, x: torch.Tensor, w: torch.Tensor) -> str:
    backend = _backend if backend is None else backend
    if backend not in _BACKENDS:
        raise ValueError(f"grouped-mm backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    ok = (
        x.device.type == "cuda"
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and hasattr(F, "grouped_mm")
        and _capability(x.device) >= (9, 0)
    )
    return "grouped_mm" if ok else "loop"


def _gated(act: Callable[[torch.Tensor], torch.Tensor], h_NX: torch.Tensor) -> torch.Tensor:
    gate_NF, up_NF = h_NX.chunk(2, dim=-1)
    return act(gate_NF) * up_NF


# Pointwise kernels of the expert path; set_compiled_kernels(True) swaps in torch.compile'd versions.
KERNELS: dict[str, Callable] = {"gated": _gated}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; use one of {sorted(ACTIVATIONS)}") from None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's CPU backward needs one)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


def _grouped_mm_mlp(x_ND, counts_E, w_gate_up_EXD, w_down_EDF, act):
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h_NX = _ContiguousGrad.apply(F.grouped_mm(x_ND, w_gate_up_EXD.transpose(-2, -1), offs=offs_E))
    a_NF = KERNELS["gated"](act, h_NX).contiguous()
    return _ContiguousGrad.apply(F.grouped_mm(a_NF, w_down_EDF.transpose(-2, -1), offs=offs_E))


def _loop_mlp(x_ND, counts: Sequence[int], w_gate_up_EXD, w_down_EDF, act):
    outs = []
    start = 0
    # Every expert runs, also with zero rows: its weights then get a zero gradient instead of None, so every
    # rank reduces the same set of gradients (FSDP2 would otherwise disagree across ranks).
    for e, n in enumerate(counts):
        x_nD = x_ND[start : start + n]
        start += n
        gate_nF, up_nF = (x_nD @ w_gate_up_EXD[e].transpose(0, 1)).chunk(2, dim=-1)
        outs.append((act(gate_nF) * up_nF) @ w_down_EDF[e].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _gated_backward(activation: str, h_NX: torch.Tensor, grad_NF: torch.Tensor) -> torch.Tensor:
    """Gradient of ``act(gate) * up`` w.r.t. ``h = [gate | up]``: the same ops autograd runs for :func:`_gated`."""
    gate_NF, up_NF = h_NX.chunk(2, dim=-1)
    if activation == "silu":
        d_gate = torch.ops.aten.silu_backward(grad_NF * up_NF, gate_NF)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        d_gate = torch.ops.aten.gelu_backward(grad_NF * up_NF, gate_NF, approximate=approximate)
    return torch.cat([d_gate, grad_NF * ACTIVATIONS[activation](gate_NF)], dim=-1)


KERNELS["gated_backward"] = _gated_backward


class ExpertPass:
    """One expert-MLP pass with a hand-written backward (for autograd Functions that schedule their own work).

    ``forward`` returns the output and the tensors backward needs (give them to ``ctx.save_for_backward``, so
    activation checkpointing can drop and recompute them like any saved tensor); ``backward`` takes them back.
    Same operations as :func:`grouped_expert_mlp` under autograd, for both backends.
    """

    def __init__(self, counts_E, host_counts, activation: str, backend: str, offsets: torch.Tensor | None = None):
        """``offsets``: the int32 cumulative ``counts_E`` when the caller computed them already (grouped_mm)."""
        self.counts_E, self.host = counts_E, list(host_counts)
        self.activation, self.backend = activation, backend
        self.offs = offsets

    def forward(self, x_ND, w_gate_up, w_down):
        act = _activation(self.activation)
        if self.backend == "grouped_mm":
            if self.offs is None:
                self.offs = torch.cumsum(self.counts_E.to(x_ND.device), 0, dtype=torch.int32)
            h_NX = F.grouped_mm(x_ND, w_gate_up.transpose(-2, -1), offs=self.offs)
            a_NF = KERNELS["gated"](act, h_NX).contiguous()
            y_ND = F.grouped_mm(a_NF, w_down.transpose(-2, -1), offs=self.offs)
            return y_ND, (x_ND, h_NX, a_NF)
        hs, outs, start = [], [], 0
        for e, n in enumerate(self.host):
            h_nX = x_ND[start : start + n] @ w_gate_up[e].transpose(0, 1)
            hs.append(h_nX)
            outs.append(_gated(act, h_nX))
            start += n
        a_NF = torch.cat(outs)
        y_ND = torch.cat([a_NF[s : s + n] @ w_down[e].transpose(0, 1) for e, (s, n) in enumerate(self._spans())])
        return y_ND, (x_ND, torch.cat(hs), a_NF)

    def _spans(self):
        start = 0
        for n in self.host:
            yield start, n
            start += n

    def backward(self, grad_ND, saved, w_gate_up, w_down, need_x: bool, need_w: bool):
        """``(grad x, grad w_gate_up, grad w_down)``; None where not needed."""
        x_ND, h_NX, a_NF = saved
        grad_ND = grad_ND.contiguous()
        gx = gw1 = gw2 = None
        if self.backend == "grouped_mm":
            ga_NF = F.grouped_mm(grad_ND, w_down, offs=self.offs)
            if need_w:
                gw2 = F.grouped_mm(grad_ND.transpose(0, 1), a_NF, offs=self.offs)
            gh_NX = KERNELS["gated_backward"](self.activation, h_NX, ga_NF).contiguous()
            if need_x:
                gx = F.grouped_mm(gh_NX, w_gate_up, offs=self.offs)
            if need_w:
                gw1 = F.grouped_mm(gh_NX.transpose(0, 1), x_ND, offs=self.offs)
            return gx, gw1, gw2
        gxs, gw1s, gw2s = [], [], []
        for e, (s, n) in enumerate(self._spans()):
            g_nD = grad_ND[s : s + n]
            ga_nF = g_nD @ w_down[e]
            gh_nX = _gated_backward(self.activation, h_NX[s : s + n], ga_nF)
            gxs.append(gh_nX @ w_gate_up[e])
            gw2s.append(g_nD.transpose(0, 1) @ a_NF[s : s + n])
            gw1s.append(gh_nX.transpose(0, 1) @ x_ND[s : s + n])
        if need_x:
            gx = torch.cat(gxs) if gxs else grad_ND.new_zeros((0, w_gate_up.shape[-1]))
        if need_w:
            gw1, gw2 = torch.stack(gw1s), torch.stack(gw2s)
        return gx, gw1, gw2


def grouped_expert_mlp(
    x_ND: torch.Tensor,
    tokens_per_expert_E: torch.Tensor | Sequence[int],
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    host_counts: Sequence[int] | None = None,
    activation: str = "silu",
    backend: Backend | None = None,
) -> torch.Tensor:
    """Run each local expert's SwiGLU MLP on its rows: ``down_e(act(gate_e x) * up_e x)``.

    Args:
        x_ND: token rows grouped by local expert (expert 0's rows first).
        tokens_per_expert_E: rows per local expert, a 1-D integer tensor on x's device or a sequence of ints
            (then copied to the device for grouped_mm); must sum to N.
        w_gate_up: ``[E, 2F, D]``, gate rows first, then up.
        w_down: ``[E, D, F]``.
        host_counts: the same counts as host ints when the caller already has them: spares the loop backend
            its one ``.tolist()`` (a device→host sync).
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"``.
        backend: ``"grouped_mm"``, ``"loop"`` or ``"auto"``; None uses :func:`get_grouped_mm_backend`.

    Returns:
        ``y_ND`` in the rows' order.
    """
    act = _activation(activation)
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
    n_counts = (
        tokens_per_expert_E.numel() if isinstance(tokens_per_expert_E, torch.Tensor) else len(tokens_per_expert_E)
    )
    if n_counts != E:
        raise ValueError(f"tokens_per_expert has {n_counts} entries for {E} local experts")
    if _resolve_backend(backend, x_ND, w_gate_up) == "grouped_mm":
        counts_E = tokens_per_expert_E
        if not isinstance(counts_E, torch.Tensor):
            counts_E = torch.tensor(list(counts_E), dtype=torch.int64, device=x_ND.device)
        return _grouped_mm_mlp(x_ND, counts_E.to(x_ND.device), w_gate_up, w_down, act)
    counts = tokens_per_expert_E if host_counts is None else host_counts
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()  # host sync: the loop needs the row counts on the host
    if sum(counts) != x_ND.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but x has {x_ND.shape[0]} rows")
    return _loop_mlp(x_ND, counts, w_gate_up, w_down, act)
