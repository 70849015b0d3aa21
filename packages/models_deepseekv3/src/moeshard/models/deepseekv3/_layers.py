"""Multi-head latent attention (MLA) of DeepSeek-V2/V3, with YaRN's attention temperature and interleaved RoPE.

Each block computes what transformers' ``modeling_deepseek_v3`` computes (same dtype casts, same order), so a
checkpoint gives the same numbers in both. Legend: B batch, S sequence, H heads, Dn the no-RoPE part of a query/key
head (``qk_nope_head_dim``), Dr its RoPE part (``qk_rope_head_dim``), Dv value head, Rq / Rkv the query and key/value
LoRA ranks, D hidden.

    q = q_b(norm(q_a(x)))  (or q_proj(x) without a query LoRA)          [B, H, S, Dn + Dr]
    c, k_rope = split(kv_a(x))                                          [B, S, Rkv], [B, 1, S, Dr]
    k_nope, v = split(kv_b(norm(c)))                                    [B, H, S, Dn], [B, H, S, Dv]
    softmax(q·k / sqrt(Dn + Dr) · mscale²) v  →  o_proj
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import DeepseekV3Config

from moeshard.models.common import AttentionOptions, RMSNorm, apply_rotary, attend, attention_output

__all__ = ["MLAttention", "apply_rotary_interleaved", "softmax_scale"]


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: DeepseekV3Config) -> float:
    """``(Dn + Dr)^-0.5``, times ``mscale(factor, mscale_all_dim)²`` under a scaled RoPE that names
    ``mscale_all_dim`` (YaRN's attention temperature, as DeepSeek and transformers apply it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    return scale


def apply_rotary_interleaved(x_BHSDr: torch.Tensor, cos_BSDr: torch.Tensor, sin_BSDr: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's checkpoints), output de-interleaved
    (first the rotated evens, then the odds), as transformers' ``apply_rotary_pos_emb_interleave``."""
    half = cos_BSDr.shape[-1] // 2
    cos, sin = cos_BSDr[..., :half].unsqueeze(1), sin_BSDr[..., :half].unsqueeze(1)
    x1, x2 = x_BHSDr[..., 0::2], x_BHSDr[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention with transformers' FQNs (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), through SDPA or flex."""

    attention_call = staticmethod(attend)
    """The attention over q, k, v (``attend``); ``apply_sequence_parallel`` replaces it on an instance with the same
    call on head shards."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        d, h, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.num_heads = self.num_kv_heads = h  # keys and values are expanded per head
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim  # these three for model_facts
        self.v_head_dim = config.v_head_dim
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.interleave = bool(config.rope_interleave)
        self.dropout = float(config.attention_dropout or 0.0)
        self.scale = softmax_scale(config)
        qk = self.nope + self.rope
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)

    def _qkv(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = x_BSD.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x_BSD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        q_BHSQ = q.view(b, s, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = torch.split(q_BHSQ, [self.nope, self.rope], dim=-1)
        c_BSR, k_rope = torch.split(self.kv_a_proj_with_mqa(x_BSD), [self.kv_lora_rank, self.rope], dim=-1)
        k_rope_B1SDr = k_rope.view(b, 1, s, self.rope)
        rotate = apply_rotary_interleaved if self.interleave else apply_rotary
        q_rope, k_rope_B1SDr = rotate(q_rope, cos, sin), rotate(k_rope_B1SDr, cos, sin)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_BSR)).view(b, s, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BHSDv = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q_BHSQ = torch.cat((q_nope, q_rope), dim=-1)
        k_BHSQ = torch.cat((k_nope, k_rope_B1SDr.expand(-1, self.num_heads, -1, -1)), dim=-1)
        return q_BHSQ, k_BHSQ, v_BHSDv

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDr: torch.Tensor,
        sin_BSDr: torch.Tensor,
        mask_B1SS: torch.Tensor | BlockMask | None,
        attention: AttentionOptions | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, S, D]``; ``mask_B1SS`` and ``attention`` as for Qwen3-MoE's attention (None:
        causal; a boolean SDPA mask; a flex ``BlockMask``; the model's ``AttentionOptions``)."""
        b, s, _ = x_BSD.shape
        q, k, v = self._qkv(x_BSD, cos_BSDr, sin_BSDr)
        dropout = self.dropout if self.training else 0.0
        out_BHSDv = self.attention_call(q, k, v, mask_B1SS, scale=self.scale, dropout=dropout, options=attention)
        return attention_output(self.o_proj, out_BHSDv.transpose(1, 2).reshape(b, s, -1), mask_B1SS, attention)
