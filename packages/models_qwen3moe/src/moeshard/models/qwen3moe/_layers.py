"""Qwen3-MoE's attention: grouped-query attention with per-head RMSNorm on q and k before RoPE.

Computes exactly what transformers' ``modeling_qwen3_moe`` computes. Legend: B batch, S sequence, H query heads,
G key/value heads, Dh head_dim, D hidden. The blocks both families share (norms, RoPE, masks, the MLP) are
``moeshard.models.common``'s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import Qwen3MoeConfig

from moeshard.models.common import AttentionOptions, RMSNorm, apply_rotary, attend, attention_output
from moeshard.models.qwen3moe._presets import head_dim

__all__ = ["Attention"]


class Attention(nn.Module):
    """Grouped-query self-attention with per-head RMSNorm on q and k before RoPE, through SDPA (causal)."""

    attention_call = staticmethod(attend)
    """The attention over q, k, v (``attend``); ``apply_sequence_parallel`` replaces it on an instance with the same
    call on head shards."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.qk_head_dim = self.v_head_dim = self.head_dim  # declared for FAMILY.facts (ATTENTION_ATTRIBUTES)
        self.dropout = float(config.attention_dropout)
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor,
        sin_BSDh: torch.Tensor,
        mask_B1SS: torch.Tensor | BlockMask | None,
        attention: AttentionOptions | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, S, D]``. ``mask_B1SS``: None (plain causal, SDPA), a boolean mask from
        :func:`build_attention_mask` / :func:`document_causal_mask` (SDPA), or a ``BlockMask`` from
        :func:`document_block_mask` (flex_attention). ``attention``: the model's kernel choice and what a checkpointed
        layer keeps (``AttentionOptions``; None: the defaults)."""
        b, s, _ = x_BSD.shape
        q = self.q_norm(self.q_proj(x_BSD).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSD).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_BSDh, sin_BSDh), apply_rotary(k, cos_BSDh, sin_BSDh)
        out_BHSDh = self.attention_call(
            q,
            k,
            v,
            mask_B1SS,
            scale=self.head_dim**-0.5,
            dropout=self.dropout if self.training else 0.0,
            enable_gqa=self.num_heads != self.num_kv_heads,
            options=attention,
        )
        return attention_output(self.o_proj, out_BHSDh.transpose(1, 2).reshape(b, s, -1), mask_B1SS, attention)
