"""What a checkpointed decoder layer keeps from its forward so that its recompute in backward does not run it again:
the attention's output, its output projection's output and the router's top-k.

Full activation checkpointing recomputes a decoder layer's forward in backward. The attention's backward needs
q, k, v (recomputed: their projections are cheap next to the attention) and the attention's output and
log-sum-exp. The last two are what the attention kernel computes; they are ``H·Dv`` compute-dtype elements and ``H``
float32 per token, where the layer's input is ``D``. The output projection's output (``D``) is needed only by the
residual and the norm after it, the top-k by the route. :class:`AttentionKeep` records them in the checkpointed
forward and hands them back in the recompute, through custom ops (:func:`kept_causal_attention`,
:func:`kept_linear`, :func:`kept_topk`), which are opaque to ``torch.compile``: the compiled attention half calls
them like the kernels they wrap, and they decide at run time whether to compute or to replay.

The attention's kernels are the ones ``scaled_dot_product_attention`` runs for a causal attention without a mask:
cuDNN's on CUDA, the flash kernel for CPU on CPU; the outputs and gradients are the same bits (tested against SDPA).
Where those kernels do not apply (another device, query and value head sizes that differ as in DeepSeek-V3's MLA,
cuDNN attention disabled, dropout, a mask) :func:`attend` computes the attention as before and the recompute runs
it.

    keep = AttentionKeep()
    checkpoint(layer, x, attention=KEPT_ATTENTION, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying()))

The mask says which keys a query sees and nothing else (None: plain causal); which kernel a plain causal attention
runs and whether it is kept are :class:`AttentionOptions`, which the model passes to every layer beside the mask.
With ``AttentionOptions(kernel="fa4", keep=True)`` the attention runs FlashAttention 4's kernels (``_fa4``), kept
and replayed the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.models.common._fa4 import fa4_applies, fa4_backward, fa4_forward, fa4_unavailable
from moeshard.models.common._topk import row_topk
from moeshard.models.common._torch_internals import (
    causal_attention_cpu,
    causal_attention_cpu_backward,
    causal_attention_cudnn,
    causal_attention_cudnn_backward,
)

__all__ = [
    "KEPT_ATTENTION",
    "AttentionKeep",
    "AttentionOptions",
    "kept_attention_applies",
    "kept_attention_device",
    "kept_causal_attention",
    "kept_linear",
    "kept_topk",
]

CAUSAL_KERNELS = ("sdpa", "fa4")
"""The kernels a plain causal attention can run: ``"sdpa"`` (what ``scaled_dot_product_attention`` picks: cuDNN's on
Hopper) and ``"fa4"`` (FlashAttention 4's, the optional ``flash-attn-4`` package; ``moeshard.models.common._fa4``)."""


@dataclass(frozen=True)
class AttentionOptions:
    """How the model's attention runs, beside its mask (which says only which keys a query sees).

    Attributes:
        kernel: the kernels of a plain causal attention (mask None), one of ``CAUSAL_KERNELS``: ``"sdpa"`` or
            ``"fa4"``; where they do not apply (a mask, dropout, head sizes) :func:`attend` runs SDPA as before.
        keep: a checkpointed layer keeps its plain causal attention's output and its output projection's output
            (:class:`AttentionKeep`; ``apply_activation_checkpointing(keep_attention=True)``).
        compiled: the attention runs compiled (``parallelize(compile=True)``): packed rows then use
            flex_attention's fused kernel under ``document_attention="auto"``.

    The model holds one (``DecoderModel.attention``) and passes it, resolved for the device of each forward
    (:meth:`on`), to every layer; one object per value, so a compiled caller sees the same constant every step.
    """

    kernel: str = "sdpa"
    keep: bool = False
    compiled: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in CAUSAL_KERNELS:
            raise ValueError(f"causal attention kernel must be one of {CAUSAL_KERNELS}, got {self.kernel!r}")

    @property
    def runs_kept(self) -> bool:
        """Whether a plain causal attention goes through :func:`kept_causal_attention` (kept, or another kernel)."""
        return self.keep or self.kernel != "sdpa"

    def on(self, device: torch.device) -> AttentionOptions:
        """These options as they apply on ``device``: ``keep`` only where :func:`kept_attention_device` (else the
        recompute runs the attention); the same object for the same values."""
        keep = self.keep and kept_attention_device(device, self.kernel)
        return _options(self.kernel, keep, self.compiled)


_OPTIONS: dict[tuple[str, bool, bool], AttentionOptions] = {}


def _options(kernel: str, keep: bool, compiled: bool) -> AttentionOptions:
    key = (kernel, bool(keep), bool(compiled))
    if key not in _OPTIONS:
        _OPTIONS[key] = AttentionOptions(*key)
    return _OPTIONS[key]


KEPT_ATTENTION = _options("sdpa", True, False)
"""The options of a plain causal attention under full activation checkpointing that keeps its output
(``apply_activation_checkpointing(keep_attention=True)``), with SDPA's kernel."""

_ACTIVE: list[tuple[AttentionKeep, str] | None] = [None]
# The keep and mode of the region being run. A process-wide slot, not a thread-local: the recompute runs on
# autograd's device thread while the thread that called backward waits for it.


class AttentionKeep:
    """One checkpointed region's kept outputs: inside :meth:`recording` each kept operation
    (:func:`kept_causal_attention`, :func:`kept_linear`, :func:`kept_topk`) computes and keeps its outputs in call
    order; inside :meth:`replaying` they are handed back in the same order, from the first again at each entry (a
    second backward through a retained graph recomputes again). A new keep per ``checkpoint`` call: what it holds
    lives as long as the checkpoint's autograd graph (its ``context_fn`` contexts hold the keep), so a backward
    frees it with the layer's graph and a forward without backward with its output."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.Tensor, ...]] = []
        self._next = 0  # the next replay's entry

    def __len__(self) -> int:
        """Kept outputs the current (or next) replay has not handed back yet."""
        return len(self._kept) - self._next

    def recording(self) -> _Mode:
        """A context (reusable) in which the kept operations compute and keep their outputs here."""
        return _Mode(self, "record")

    def replaying(self) -> _Mode:
        """A context (reusable) in which the kept operations return the kept outputs, from the first, instead of
        computing."""
        return _Mode(self, "replay")

    def _push(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self._kept.append(tuple(t.detach() for t in outputs))

    def _replay(self, op: str, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The next kept outputs, checked against what the recompute's ``op`` would compute (its first output's
        shape, and dtype and device of ``like``)."""
        if self._next >= len(self._kept):
            raise RuntimeError(
                f"{op}: the recompute runs more kept operations than its forward kept; the checkpointed region must "
                "call the same operations in the same order when it is recomputed"
            )
        outputs = self._kept[self._next]
        first, shape = outputs[0], tuple(shape)
        if tuple(first.shape) != shape or first.dtype != like.dtype or first.device != like.device:
            raise RuntimeError(
                f"{op}: the recompute's ({shape}, {like.dtype}, {like.device}) is not the one its forward kept "
                f"({tuple(first.shape)}, {first.dtype}, {first.device}); the checkpointed region must recompute the "
                "same operations in the same order"
            )
        self._next += 1
        return outputs


class _Mode:
    """Entered: the kept operations record into (or replay from) ``keep``. Reusable, as checkpointing enters its
    recompute context once per recompute."""

    def __init__(self, keep: AttentionKeep, mode: str) -> None:
        self.keep, self.mode = keep, mode
        self._outer: list[tuple[AttentionKeep, str] | None] = []

    def __enter__(self) -> AttentionKeep:
        if self.mode == "replay":
            self.keep._next = 0
        self._outer.append(_ACTIVE[0])
        _ACTIVE[0] = (self.keep, self.mode)
        return self.keep

    def __exit__(self, *exc) -> None:
        _ACTIVE[0] = self._outer.pop()


def kept_attention_device(device: torch.device | str, kernel: str = "sdpa") -> bool:
    """Whether :func:`kept_causal_attention` has ``kernel``'s kernels on ``device``. ``"sdpa"``: CPU, or CUDA with
    cuDNN attention enabled on a GPU of compute capability 9.0 or more; ``"fa4"``: where
    :func:`~moeshard.models.common._fa4.fa4_unavailable` finds no reason against it. The model asks once per
    forward, eagerly; see :func:`kept_attention_applies` for the per-call conditions, which are traced."""
    device = torch.device(device)
    if kernel == "fa4":
        return fa4_unavailable(device) is None
    if device.type == "cpu":
        return True
    return (
        device.type == "cuda"
        and torch.backends.cuda.cudnn_sdp_enabled()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def kept_attention_applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, kernel: str = "sdpa"
) -> bool:
    """Whether :func:`kept_causal_attention` computes this causal attention with ``kernel``, on a device where
    :func:`kept_attention_device`: ``[B, H, S, D]`` with one head size for q, k and v, no dropout; on CUDA half
    precision and a head size that is a multiple of 8, up to 128 for SDPA's (cuDNN's) and 256 for FlashAttention
    4's. Shapes and dtypes only, so a compiled caller traces it without a graph break."""
    if kernel == "fa4":
        return fa4_applies(q, k, v, dropout)
    if dropout > 0 or q.dim() != 4 or q.shape[-1] != k.shape[-1] or q.shape[-1] != v.shape[-1]:
        return False
    if q.device.type == "cpu":
        return True
    d = q.shape[-1]
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 128


def _compute(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """``(out, logsumexp, philox seed, philox offset)`` of the causal attention, by the kernel SDPA picks."""
    if q.device.type == "cuda":
        return causal_attention_cudnn(q, k, v, scale)
    out, lse = causal_attention_cpu(q, k, v, scale)
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    return out, lse, empty, empty.clone()


def _recorded_or_replayed(compute, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """``compute(q, k, v, scale)``'s outputs, kept inside a recording keep; inside a replaying one the kept outputs
    instead, without computing (an output's shape is q's with v's head size, in either layout)."""
    active = _ACTIVE[0]
    if active is not None and active[1] == "replay":
        return active[0]._replay("kept_causal_attention", (*q.shape[:-1], v.shape[-1]), q)
    outputs = compute(q, k, v, scale)
    if active is not None:
        active[0]._push(outputs)
    return outputs


@torch.library.custom_op("moeshard::kept_causal_attention", mutates_args=())
def _kept_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _recorded_or_replayed(_compute, q, k, v, scale)


@_kept_causal_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    return _compute(q, k, v, scale)  # the aten kernels' own meta functions: the same shapes and strides


def _setup_context(ctx, inputs, output) -> None:
    # Backward reads every output, so each is saved: an output of the compiled forward, whose buffer compiled code
    # never reuses for another value. The keep holds the same storage without a copy. An output backward does not
    # read may be overwritten once its readers ran: the keep holds a copy of it (_kept_linear, _kept_topk).
    q, k, v, scale = inputs
    out, lse, seed, offset = output
    ctx.save_for_backward(q, k, v, out, lse, seed, offset)
    ctx.scale = scale
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, *_):
    q, k, v, out, lse, seed, offset = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None
    if q.device.type == "cuda":
        dq, dk, dv = causal_attention_cudnn_backward(grad_out, q, k, v, out, lse, seed, offset, ctx.scale)
    else:
        dq, dk, dv = causal_attention_cpu_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_kept_causal_attention.register_autograd(_backward, setup_context=_setup_context)


# ---- FlashAttention 4's kernels, on [B, S, heads, D] ---------------------------------------------------------


@torch.library.custom_op("moeshard::kept_causal_attention_fa4", mutates_args=())
def _kept_causal_attention_fa4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _recorded_or_replayed(fa4_forward, q, k, v, scale)


@_kept_causal_attention_fa4.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


def _fa4_setup_context(ctx, inputs, output) -> None:
    q, k, v, scale = inputs  # every output is read by backward, so the keep holds them without a copy (above)
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale
    ctx.set_materialize_grads(False)


@torch.library.custom_op("moeshard::causal_attention_fa4_backward", mutates_args=())
def _fa4_backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # An op of its own: compiled code traces a backward rule with fake tensors, which FlashAttention 4's host code
    # (its kernels' compile and launch) does not take.
    return fa4_backward(grad_out, q, k, v, out, lse, scale)


@_fa4_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_backward_rule(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None
    return (*_fa4_backward_op(grad_out, q, k, v, out, lse, ctx.scale), None)


_kept_causal_attention_fa4.register_autograd(_fa4_backward_rule, setup_context=_fa4_setup_context)


def kept_causal_attention(
    q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, scale: float, kernel: str = "sdpa"
) -> torch.Tensor:
    """``softmax(q·kᵀ·scale, causal) v`` ``[B, H, S, D]`` (grouped-query where ``G < H``) where
    :func:`kept_attention_applies`. ``kernel="sdpa"``: the same bits as ``scaled_dot_product_attention(...,
    is_causal=True, enable_gqa=...)``; ``"fa4"``: FlashAttention 4's kernels, on the ``[B, S, heads, D]`` tensors
    the ``[B, heads, S, D]`` arguments are transposed views of (the layout the projections write: no copy).
    Inside :meth:`AttentionKeep.recording` its output and log-sum-exp are kept; inside
    :meth:`AttentionKeep.replaying` they are returned again without running the kernel (the recompute of a
    checkpointed region), with the gradient of the attention they came from."""
    if kernel == "fa4":
        q, k, v = (t.transpose(1, 2) for t in (q_BHSD, k_BGSD, v_BGSD))
        return _kept_causal_attention_fa4(q, k, v, float(scale))[0].transpose(1, 2)
    return _kept_causal_attention(q_BHSD, k_BGSD, v_BGSD, float(scale))[0]


# ---- the attention's output projection ---------------------------------------------------------------------------


@torch.library.custom_op("moeshard::kept_linear", mutates_args=())
def _kept_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    active = _ACTIVE[0]
    if active is not None and active[1] == "replay":
        return active[0]._replay("kept_linear", (*x.shape[:-1], weight.shape[0]), x)[0]
    y = torch.nn.functional.linear(x, weight)
    if active is not None:
        # A copy: backward does not read y, so compiled code may write another value into its buffer once the
        # residual has read it (see _setup_context).
        active[0]._push((y.clone(),))
    return y


@_kept_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _linear_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_2d = grad_y.reshape(-1, grad_y.shape[-1])
    grad_x = (grad_2d @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = grad_2d.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w


_kept_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def kept_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias), kept and replayed as :func:`kept_causal_attention`: a checkpointed
    layer keeps its attention's output projection (``D`` elements per token), so its recompute runs no GEMM for it
    (the residual and norm after it only need its output)."""
    return _kept_linear(x, weight)


# ---- the routers' top-k ------------------------------------------------------------------------------------------


@torch.library.custom_op("moeshard::kept_topk", mutates_args=())
def _kept_topk(scores: torch.Tensor, k: int, by_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    active = _ACTIVE[0]
    if active is not None and active[1] == "replay":
        return active[0]._replay("kept_topk", (*scores.shape[:-1], k), scores)
    kernel = None
    if by_kernel:
        from moeshard.models.common._topk_triton import topk_ids as kernel
    values, ids = row_topk(scores, k, kernel)
    if active is not None:
        active[0]._push((values.clone(), ids))  # the values copied: backward reads only the ids (_kept_linear)
    return values, ids


@_kept_topk.register_fake
def _(scores: torch.Tensor, k: int, by_kernel: bool):
    shape = (*scores.shape[:-1], k)
    return scores.new_empty(shape), scores.new_empty(shape, dtype=torch.int64)


def _topk_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])
    ctx.shape = inputs[0].shape
    ctx.set_materialize_grads(False)


def _topk_backward(ctx, grad_values, _grad_ids):
    (ids,) = ctx.saved_tensors
    if grad_values is None:
        return None, None, None
    return grad_values.new_zeros(ctx.shape).scatter(-1, ids, grad_values), None, None


_kept_topk.register_autograd(_topk_backward, setup_context=_topk_setup)


def kept_topk(scores: torch.Tensor, k: int, *, by_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(scores, k, dim=-1)`` (values and int64 indices, sorted), kept and replayed as
    :func:`kept_causal_attention`: a checkpointed layer's recompute takes its router's selection from the forward
    instead of selecting again. ``by_kernel``: select with the Triton kernel where ``row_topk`` would (CUDA)."""
    return _kept_topk(scores, int(k), bool(by_kernel))
