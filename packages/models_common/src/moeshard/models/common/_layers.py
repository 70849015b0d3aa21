"""Dense building blocks every family shares: the token embedding, RMSNorm, RoPE (the config's scaling), the
attention masks and the attention call under them, and the dense SwiGLU MLP.

Each block computes exactly what transformers computes for Qwen3-MoE and DeepSeek-V3 (same dtype casts, same
order), so a checkpoint gives the same numbers in both. Legend: B batch, S sequence, H query heads, G key/value
heads, Dh head_dim, Dr the rotated width, D hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moeshard.models.common._kept import (
    AttentionOptions,
    kept_attention_applies,
    kept_causal_attention,
    kept_linear,
)
from moeshard.models.common._torch_internals import has_call_hooks

__all__ = [
    "DenseMLP",
    "EmbeddingOptions",
    "RMSNorm",
    "RotaryEmbedding",
    "TokenEmbedding",
    "ZeroCenteredRMSNorm",
    "apply_rotary",
    "attend",
    "attention_output",
    "build_attention_mask",
    "document_block_mask",
    "document_causal_mask",
    "rms_norm",
    "zero_centered_rms_norm",
]


class _EmbeddingIntoTarget(torch.autograd.Function):
    """``F.embedding``; backward adds the rows' float32 gradients into the weight's gradient target."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, target) -> torch.Tensor:  # noqa: D102
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.target = padding_idx, target
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (ids,) = ctx.saved_tensors
        ids_N = ids.reshape(-1)
        rows_ND = grad.reshape(ids_N.shape[0], -1).to(ctx.target.dtype)
        if ctx.padding_idx is not None:  # as the embedding's own backward: the padding row gets no gradient
            rows_ND = torch.where((ids_N == ctx.padding_idx)[:, None], 0.0, rows_ND)
        # Repeated tokens summed in float32 (on CUDA by a sort of the ids, as the embedding's own backward).
        ctx.target.zeros_if_none().index_put_((ids_N,), rows_ND, accumulate=True)
        return None, None, None, None


@dataclass(frozen=True)
class EmbeddingOptions:
    """Where a :class:`TokenEmbedding`'s weight gradient goes.

    Attributes:
        grad_target: None (autograd's gradient), or the embedding's ``moeshard.fsdp_moe.reduced_grad_target``
            (``parallelize`` gives it).
    """

    grad_target: Callable | None = None


class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` (same parameter, same numbers forward) whose weight gradient can go to a float32 target.

    ``options.grad_target`` (an :class:`EmbeddingOptions`, the defaults until ``parallelize`` replaces it whole) is
    asked in each forward with grad: where it answers a holder, backward adds the ``B·S`` rows' gradients
    into it in float32 (``index_put_`` with accumulation; FSDP2 reduces them as its own float32 gradient) instead
    of autograd's dense ``[V, D]`` gradient in the weight's dtype, which FSDP2 would then cast or add in float32
    (two passes over ``[V, D]`` per micro-batch).
    """

    options: EmbeddingOptions = EmbeddingOptions()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: D102
        target = None
        grad_target = self.options.grad_target
        if grad_target is not None and torch.is_grad_enabled() and self.weight.requires_grad:
            target = grad_target(self.weight)
        if target is None or self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return super().forward(input)
        return _EmbeddingIntoTarget.apply(input, self.weight, self.padding_idx, target)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the statistics in float32 (transformers' Qwen3 RMSNorm)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight) * (x / rms(x))``, all in float32, cast to the input dtype last (the norm whose weight is 0
    at init: Gemma's, Qwen3-Next's and Qwen3.5's)."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight in the input dtype.

    ``zero_centered`` (a class attribute, True in :class:`ZeroCenteredRMSNorm`): the norm kind whose weight is an offset from one (``(1 + w) · x / rms(x)``, the
    product in float32, :func:`zero_centered_rms_norm`), initialised to zeros; a family picks the kind through
    ``DecoderModel.norm_class``.
    """

    zero_centered = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if self.zero_centered else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return zero_centered_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Ones (zeros for the zero-centred kind), as transformers initialises norms."""
        (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}" + (", zero_centered" if self.zero_centered else "")


class ZeroCenteredRMSNorm(RMSNorm):
    """:class:`RMSNorm` of the zero-centred kind: ``(1 + weight) · x / rms(x)``, weight zeros at init."""

    zero_centered = True


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables of width ``config.head_dim`` (the rotated part of a head: Qwen3-MoE's head_dim,
    DeepSeek-V3's ``qk_rope_head_dim``) times ``rope_parameters["partial_rotary_factor"]`` (default 1; Qwen3.5
    rotates a quarter of each head) for given positions, in the activations' dtype.

    The default RoPE is computed here (``1 / theta^(2i / dim)``); the scaled ones (``linear``, ``yarn``, ...) and
    their tables' scaling (YaRN's ``attention_factor``) come from transformers' RoPE initialisers for the config's
    ``rope_type``. In float32 on the CPU, as transformers at construction, and cached per device (not a buffer: a
    model built on ``meta`` and materialised with ``to_empty`` needs no extra step).
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dim = int(head_dim * float((config.rope_parameters or {}).get("partial_rotary_factor", 1.0) or 1.0))
        self.rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        self._cache: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._cache:
            if self.rope_type == "default":
                dim, base = self.dim, float(self.config.rope_parameters["rope_theta"])
                exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
                inv_freq, scaling = 1.0 / (base**exponent), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, "cpu")
            self._cache[device] = (inv_freq.float().to(device), float(scaling))
        return self._cache[device]

    def forward(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos_BSDr, sin_BSDr)`` for integer positions ``[B, S]`` (Dr: the rotated width)."""
        inv_freq, scaling = self._tables(position_ids_BS.device)
        freqs = position_ids_BS[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type}, dim={self.dim}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHSDh: torch.Tensor, cos_BSDh: torch.Tensor, sin_BSDh: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (heads on dim 1) by the RoPE tables (non-interleaved halves, as transformers). Tables narrower
    than the head (partial rotary) rotate its first ``Dr`` dims and pass the rest through."""
    cos, sin = cos_BSDh.unsqueeze(1), sin_BSDh.unsqueeze(1)
    dr = cos.shape[-1]
    if dr < x_BHSDh.shape[-1]:
        x_rot, x_pass = x_BHSDh[..., :dr], x_BHSDh[..., dr:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
    return x_BHSDh * cos + _rotate_half(x_BHSDh) * sin


def build_attention_mask(attention_mask_BS: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """Boolean SDPA mask ``[B, 1, S, S]`` (True = attend): causal and not a padded key; None when no padding mask.

    A query whose visible keys are all padding (left padding) gets a fully masked row; SDPA returns zeros there,
    as in transformers, so padded positions stay finite.
    """
    if attention_mask_BS is None:
        return None
    if attention_mask_BS.dim() != 2 or attention_mask_BS.shape[1] != seq_len:
        raise ValueError(
            f"attention_mask must be [batch, seq_len={seq_len}] with 1 for tokens and 0 for padding, "
            f"got shape {tuple(attention_mask_BS.shape)}"
        )
    device = attention_mask_BS.device
    causal_SS = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    return causal_SS[None, None] & attention_mask_BS.bool()[:, None, None, :]


def document_causal_mask(document_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean SDPA mask ``[B, 1, S, S]`` (True = attend) of packed rows: token ``t`` attends to ``j <= t`` of its
    own document (equal ``document_ids``; padding carries its own id, e.g. -1), and not to padded keys when an
    ``attention_mask`` is given. Dense: the CPU reference path; on CUDA :func:`document_block_mask` skips the
    masked blocks instead."""
    if document_ids_BS.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq_len], got shape {tuple(document_ids_BS.shape)}")
    s = document_ids_BS.shape[1]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=document_ids_BS.device).tril()
    mask = (document_ids_BS[:, :, None] == document_ids_BS[:, None, :]) & causal_SS
    if attention_mask_BS is not None:
        mask = mask & attention_mask_BS.bool()[:, None, :]
    return mask[:, None]


def document_block_mask(document_ids_BS: torch.Tensor) -> BlockMask:
    """flex_attention ``BlockMask`` of the same rule as :func:`document_causal_mask` (no attention_mask: padding
    is its own document): blocks where no query sees a key of its document are skipped, so a row of short
    documents costs less attention than one long document."""
    if document_ids_BS.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq_len], got shape {tuple(document_ids_BS.shape)}")
    b, s = document_ids_BS.shape
    doc = document_ids_BS

    def same_document_causal(b_, h_, q_, kv_):
        return (doc[b_, q_] == doc[b_, kv_]) & (kv_ <= q_)

    return create_block_mask(same_document_causal, b, None, s, s, device=doc.device)


def attend(
    q_BHSDq: torch.Tensor,
    k_BGSDq: torch.Tensor,
    v_BGSDv: torch.Tensor,
    mask_B1SS: torch.Tensor | BlockMask | None,
    *,
    scale: float,
    dropout: float = 0.0,
    enable_gqa: bool = False,
    options: AttentionOptions | None = None,
) -> torch.Tensor:
    """``softmax(q·kᵀ·scale + mask) v`` ``[B, H, S, Dv]`` under one of the model's masks: None (plain causal,
    SDPA), a boolean mask from :func:`build_attention_mask` / :func:`document_causal_mask` (SDPA), or a
    ``BlockMask`` from :func:`document_block_mask` (flex_attention: the fused kernel where the caller runs compiled,
    ``parallelize(compile=True)`` compiles the attention half holding this call; eagerly a dense reference, for
    CPU tests; never compiled here). ``dropout``: the attention dropout (0 in eval); refused with a ``BlockMask``.
    ``options`` (the model's :class:`AttentionOptions`; None: the defaults): a plain causal attention (mask None)
    that runs FlashAttention 4's kernels or that full activation checkpointing keeps (e.g. ``KEPT_ATTENTION``) goes
    through :func:`kept_causal_attention` with that kernel where it applies, else through SDPA."""
    if mask_B1SS is None and options is not None and options.runs_kept:
        if kept_attention_applies(q_BHSDq, k_BGSDq, v_BGSDv, dropout, options.kernel):
            return kept_causal_attention(q_BHSDq, k_BGSDq, v_BGSDv, scale, options.kernel)
    if isinstance(mask_B1SS, BlockMask):
        if dropout > 0:
            raise ValueError(
                f"attention_dropout={dropout} is not supported with document masking (flex_attention); "
                "set attention_dropout to 0"
            )
        return flex_attention(q_BHSDq, k_BGSDq, v_BGSDv, block_mask=mask_B1SS, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(
        q_BHSDq,
        k_BGSDq,
        v_BGSDv,
        attn_mask=mask_B1SS,
        dropout_p=dropout,
        is_causal=mask_B1SS is None,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def attention_output(
    o_proj: nn.Module, x_BSX: torch.Tensor, mask_B1SS: object, options: AttentionOptions | None = None
) -> torch.Tensor:
    """``o_proj(x_BSX)``, the attention's output projection, under the mask and options the layer got: for a plain
    causal attention (mask None) whose options keep (``KEPT_ATTENTION``: full activation checkpointing that keeps the
    attention's output), a plain ``nn.Linear`` without bias runs as :func:`kept_linear`, so the layer's recompute
    takes its output from the forward instead of running the GEMM. A module with hooks (a LoRA adapter is a forward
    hook) is called instead: its output is more than the GEMM's."""
    keep = mask_B1SS is None and options is not None and options.keep
    if keep and type(o_proj) is nn.Linear and o_proj.bias is None and not has_call_hooks(o_proj):
        return kept_linear(x_BSX, o_proj.weight)
    return o_proj(x_BSX)


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``: the layers without experts, and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        d, i = hidden_size, intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
