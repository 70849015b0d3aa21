"""Qwen3.5-MoE's two sequence mixers: the Gated DeltaNet (linear attention) and gated full attention.

Each computes exactly what transformers' ``modeling_qwen3_5_moe`` computes (same dtype casts, same order). Legend:
B batch, S sequence, H query (or DeltaNet value) heads, G key/value (DeltaNet key) heads, Dh head_dim, Dk / Dv the
DeltaNet's key / value head sizes, C its convolution channels (``2·G·Dk + H·Dv``), D hidden.

    DeltaNet:  q, k, v = silu(causal_conv(in_proj_qkv(x)))     β = sigmoid(in_proj_b(x))
               g = -exp(A_log) · softplus(in_proj_a(x) + dt_bias)       (the gated delta rule's decay, log space)
               o = out_proj(rms_norm(delta_rule(q, k, v, g, β)) · silu(in_proj_z(x)))
    attention: q, gate = split(q_proj(x)); o = o_proj(attend(rope(q_norm(q)), rope(k_norm(k)), v) · sigmoid(gate))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import Qwen3_5MoeTextConfig

from moeshard.models.common import (
    DELTA_RULE_CHUNK,
    AttentionOptions,
    RMSNorm,
    RowSegments,
    ZeroCenteredRMSNorm,
    apply_rotary,
    attend,
    attention_output,
    delta_rule_flops_per_token,
    linear_attention_kernels,
    linear_attention_row,
)

__all__ = ["GatedAttention", "GatedDeltaNet", "GatedRMSNorm"]


class GatedRMSNorm(RMSNorm):
    """RMSNorm of each value head's output, then times ``silu(gate)`` (the gate in float32), as transformers'
    ``Qwen3_5MoeRMSNormGated``; weight ones at init."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet layer with transformers' FQNs (``linear_attn.{in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a, conv1d, dt_bias, A_log, norm, out_proj}``).

    Its decoder gives it the row's :class:`RowSegments` (``mask_kind = "segments"``): padding is zeroed at the
    input (as transformers), and in packed rows the convolution and the recurrent state restart at every document.
    ``kernel``: ``"auto"`` (flash-linear-attention on CUDA, the torch reference elsewhere), ``"fla"`` or ``"torch"``
    (see ``moeshard.models.common.linear_attention_kernels``).
    """

    mask_kind = "segments"

    row_call = staticmethod(linear_attention_row)
    """The convolution and the delta rule along the whole row, on the heads given (``linear_attention_row``);
    ``apply_sequence_parallel`` replaces it on an instance with the same call on head shards."""

    def __init__(self, config: Qwen3_5MoeTextConfig, kernel: str = "auto") -> None:
        super().__init__()
        d = config.hidden_size
        self.num_v_heads, self.num_k_heads = config.linear_num_value_heads, config.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.kernel = kernel
        # declared for FAMILY.facts (ATTENTION_ATTRIBUTES): value heads, key heads, head sizes, the state's FLOPs
        self.num_heads, self.num_kv_heads = self.num_v_heads, self.num_k_heads
        self.qk_head_dim, self.v_head_dim = self.head_k_dim, self.head_v_dim
        self.recurrent_flops_per_token = delta_rule_flops_per_token(self.num_v_heads, self.head_k_dim, self.head_v_dim)
        conv_dim, width = 2 * self.key_dim + self.value_dim, config.linear_conv_kernel_dim
        # For plan's memory (FAMILY.facts), as flash-linear-attention's chunked kernels run: backward keeps the
        # convolved q, k, v, the rule's output (the gated norm's input), each chunk's WY matrix (H x chunk per token)
        # and the per-head gates (g, β and their inputs); the per-chunk states [H, Dk, Dv] exist only while a layer
        # runs (recomputed in backward).
        h = self.num_v_heads
        self.recurrent_activations_per_token = conv_dim + self.value_dim + h * (DELTA_RULE_CHUNK + 4)
        self.recurrent_state_per_token = h * self.head_k_dim * self.head_v_dim // DELTA_RULE_CHUNK
        # Registered in transformers' order, so state dicts list the same keys in the same order.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, width, bias=False, groups=conv_dim, padding=width - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)
        self.in_proj_qkv = nn.Linear(d, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)

    @torch.no_grad()
    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """As transformers: ``dt_bias`` ones, ``A_log = log(uniform(0.01, 16))``, the convolution normal(0, std)
        (the linear layers and the norm are the model's ``init_weights``)."""
        nn.init.ones_(self.dt_bias)
        nn.init.uniform_(self.A_log, 0.01, 16.0, generator=generator)
        self.A_log.log_()
        nn.init.normal_(self.conv1d.weight, mean=0.0, std=std, generator=generator)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor | None = None,
        sin_BSDh: torch.Tensor | None = None,
        segments: RowSegments | BlockMask | None = None,
        attention: AttentionOptions | None = None,
    ) -> torch.Tensor:
        """Output ``[B, S, D]``; positions play no part (the state orders the tokens), ``attention`` neither."""
        segments = segments if isinstance(segments, RowSegments) else RowSegments()
        b, s, _ = x_BSD.shape
        mask_BS = segments.local_attention_mask(s)
        if mask_BS is not None:  # padding in, zeros in (transformers' apply_mask_to_padding)
            x_BSD = (x_BSD * mask_BS[:, :, None]).to(x_BSD.dtype)
        q, k, v = torch.split(self.in_proj_qkv(x_BSD), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        w_CK = self.conv1d.weight.squeeze(1)
        w_q, w_k, w_v = torch.split(w_CK, [self.key_dim, self.key_dim, self.value_dim])
        z_BSHDv = self.in_proj_z(x_BSD).reshape(b, s, -1, self.head_v_dim)
        beta_BSH = self.in_proj_b(x_BSD).sigmoid()
        g_BSH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BSD).float() + self.dt_bias)
        out_BSHDv = self.row_call(
            q.reshape(b, s, -1, self.head_k_dim),
            k.reshape(b, s, -1, self.head_k_dim),
            v.reshape(b, s, -1, self.head_v_dim),
            g_BSH,
            beta_BSH,
            (
                w_q.reshape(self.num_k_heads, self.head_k_dim, -1),
                w_k.reshape(self.num_k_heads, self.head_k_dim, -1),
                w_v.reshape(self.num_v_heads, self.head_v_dim, -1),
            ),
            segments,
            linear_attention_kernels(self.kernel, x_BSD.device),
        )
        out = self.norm(out_BSHDv.reshape(-1, self.head_v_dim), z_BSHDv.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(b, s, -1))

    def extra_repr(self) -> str:
        return f"heads={self.num_v_heads}/{self.num_k_heads}, kernel={self.kernel}"


class GatedAttention(nn.Module):
    """Grouped-query attention with zero-centred RMSNorm on q and k, partial rotary, and an output gate
    (``q_proj`` yields each head's query and its gate), through SDPA or flex."""

    attention_call = staticmethod(attend)
    """The attention over q, k, v (``attend``); ``apply_sequence_parallel`` replaces it on an instance with the same
    call on head shards."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        d, bias = config.hidden_size, config.attention_bias
        self.head_dim = config.head_dim or d // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qk_head_dim = self.v_head_dim = self.head_dim  # declared for FAMILY.facts (ATTENTION_ATTRIBUTES)
        self.dropout = float(config.attention_dropout or 0.0)
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDr: torch.Tensor,
        sin_BSDr: torch.Tensor,
        mask_B1SS: torch.Tensor | BlockMask | None,
        attention: AttentionOptions | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, S, D]``; ``mask_B1SS`` and ``attention`` as for every family's attention (None:
        causal; a boolean SDPA mask; a flex ``BlockMask``; the model's ``AttentionOptions``)."""
        b, s, _ = x_BSD.shape
        q, gate = torch.chunk(self.q_proj(x_BSD).view(b, s, -1, 2 * self.head_dim), 2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BSD).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_BSDr, sin_BSDr), apply_rotary(k, cos_BSDr, sin_BSDr)
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
        out_BSX = out_BHSDh.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate.reshape(b, s, -1))
        return attention_output(self.o_proj, out_BSX, mask_B1SS, attention)
