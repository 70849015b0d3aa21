"""GPT-OSS's attention: grouped-query attention with biased projections, a learned sink logit per head and, in
``sliding_attention`` layers, a window of the last ``sliding_window`` keys.

Computes what transformers' ``modeling_gpt_oss`` computes. Legend: B batch, S sequence, H query heads, G key/value
heads, Dh head_dim, D hidden. A head's sink is one more logit in its softmax that takes probability mass and gives
no value: ``out = Σ_j p_j v_j`` with ``p = softmax([q·k_j · scale, sink])`` over the visible keys and the sink.

Each layer gets the model's masks for both layer types (:func:`sliding_masks`) and takes its own:

- a boolean ``[B, 1, S, S]`` mask (the dense reference, CPU): the sink is an extra column of the softmax;
- a flex ``BlockMask`` (CUDA; the fused kernel where the layer runs compiled): flex_attention's output over the
  keys and its log-sum-exp ``lse`` give the sink's share exactly, ``out · sigmoid(lse - sink)``; no ``S x S``
  tensor, and the window's blocks beyond it are skipped.

Under sequence parallelism (``moeshard.models.common.apply_sequence_parallel``) the same call runs between the two
all-to-alls on each rank's ``H/sp`` query heads of the whole row, with those heads' sinks.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import GptOssConfig

from moeshard.models.common import AttentionOptions, apply_rotary

__all__ = ["GptOssAttention", "sink_attention", "sliding_masks"]


def sink_attention(
    q_BHSDh: torch.Tensor,
    k_BGSDh: torch.Tensor,
    v_BGSDh: torch.Tensor,
    mask_B1SS: torch.Tensor | BlockMask,
    sinks_H: torch.Tensor,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``[B, H, S, Dh]``: attention with one sink logit per head under a boolean mask (True = attend) or a
    ``BlockMask``; key/value heads are shared by ``H / G`` query heads each."""
    if isinstance(mask_B1SS, BlockMask):
        if dropout > 0:
            raise ValueError(f"attention_dropout={dropout} is not supported with flex attention; set it to 0")
        out, lse_BHS = flex_attention(
            q_BHSDh, k_BGSDh, v_BGSDh, block_mask=mask_B1SS, scale=scale, enable_gqa=True, return_lse=True
        )
        keep_BHS = torch.sigmoid(lse_BHS.float() - sinks_H.float()[None, :, None])
        return (out.float() * keep_BHS.unsqueeze(-1)).to(q_BHSDh.dtype)
    rep = q_BHSDh.shape[1] // k_BGSDh.shape[1]
    k = k_BGSDh.repeat_interleave(rep, dim=1)
    v = v_BGSDh.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q_BHSDh, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask_B1SS, torch.finfo(scores.dtype).min)
    b, h, s, _ = scores.shape
    sinks = sinks_H.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, h, s, 1)
    logits = torch.cat([scores, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values  # as transformers: no overflow in bf16
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=dropout > 0).to(v.dtype)
    return torch.matmul(probs, v)


def sliding_masks(
    base: torch.Tensor | BlockMask | None,
    window: int,
    document_ids_BS: torch.Tensor | None,
    s: int,
    device: torch.device,
) -> dict[str, torch.Tensor | BlockMask]:
    """``{"full_attention": mask, "sliding_attention": mask}`` from the mask every other family gets (``base``:
    None for plain causal, a boolean ``[B, 1, S, S]``, or a document ``BlockMask``): the sliding one also hides keys
    ``window`` or more positions back (``q - kv < window``, as transformers). On CUDA, a plain causal row gets
    ``BlockMask`` s (no ``S x S`` tensor); elsewhere the masks are dense booleans."""
    if isinstance(base, BlockMask) or (base is None and device.type == "cuda"):
        doc = document_ids_BS

        def full(b, h, q, kv):
            same = (kv <= q) if doc is None else (doc[b, q] == doc[b, kv]) & (kv <= q)
            return same

        def sliding(b, h, q, kv):
            return full(b, h, q, kv) & (q - kv < window)

        batch = 1 if doc is None else doc.shape[0]
        full_mask = base if base is not None else create_block_mask(full, batch, None, s, s, device=device)
        return {
            "full_attention": full_mask,
            "sliding_attention": create_block_mask(sliding, batch, None, s, s, device=device),
        }
    if base is None:
        base = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None, None]
    pos = torch.arange(s, device=device)
    band_SS = (pos[:, None] - pos[None, :]) < window
    return {"full_attention": base, "sliding_attention": base & band_SS}


def _sinks_on_head_shard(q_BhSDh, k_BgSDh, v_BgSDh, mask_B1SS, sinks_H, scale, dropout, *, group):
    """:func:`sink_attention` on this rank's head shard under sequence parallelism: rank ``r`` of ``group`` holds
    query heads ``[r·h, (r+1)·h)`` of the ``H`` (``moeshard.sequence``'s layout), so it takes their sinks."""
    pg = group.get_group() if isinstance(group, DeviceMesh) else group
    h = q_BhSDh.shape[1]
    assert h * dist.get_world_size(pg) == sinks_H.shape[0], (h, sinks_H.shape)
    r = dist.get_rank(pg)
    return sink_attention(q_BhSDh, k_BgSDh, v_BgSDh, mask_B1SS, sinks_H[r * h : (r + 1) * h], scale, dropout)


class _HeadShardCall:
    """``attention_call`` of GPT-OSS's attention: None by default (the sinks' own call, :func:`sink_attention`,
    runs on every head). ``apply_sequence_parallel`` sets a head-shard wrapper of the shared attention call (a
    dataclass with ``attn_fn`` and ``group``, ``moeshard.sequence.UlyssesAttention``); the attention then runs that
    wrapper with the sinks' call in place of ``attn_fn``, each rank on its heads' sinks. Sliding windows need
    nothing: each rank sees the whole row."""

    def __get__(self, obj, owner=None):
        return None if obj is None else obj.__dict__.get("_head_shard_call")

    def __set__(self, obj, value):
        if value is not None and not (
            dataclasses.is_dataclass(value) and hasattr(value, "attn_fn") and hasattr(value, "group")
        ):
            raise ValueError(
                f"GPT-OSS's attention takes a head-shard wrapper with attn_fn and group as attention_call (its "
                f"sinks need their own call), got {type(value).__name__}; use moeshard.models.common."
                "apply_sequence_parallel"
            )
        obj.__dict__["_head_shard_call"] = value


class GptOssAttention(nn.Module):
    """Grouped-query self-attention with biased q/k/v/o, a sink logit per head (``sinks [H]``) and the layer's
    window (``sliding_window`` for ``sliding_attention`` layers, None for ``full_attention``)."""

    attention_call = _HeadShardCall()

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.qk_head_dim = self.v_head_dim = self.head_dim  # declared for FAMILY.facts (ATTENTION_ATTRIBUTES)
        self.attention_window = self.sliding_window  # FAMILY.facts counts a window layer's keys up to it
        self.dropout = float(config.attention_dropout)
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for the sinks, as transformers (the projections are initialised as linear layers)."""
        nn.init.normal_(self.sinks, mean=0.0, std=std, generator=generator)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor,
        sin_BSDh: torch.Tensor,
        masks: dict[str, torch.Tensor | BlockMask] | None,
        attention: AttentionOptions | None = None,
    ) -> torch.Tensor:
        """Attention output ``[B, S, D]`` under ``masks[self.layer_type]`` (:func:`sliding_masks`; None: causal)."""
        b, s, _ = x_BSD.shape
        if masks is None:
            masks = sliding_masks(None, self.sliding_window or s, None, s, x_BSD.device)
        q = self.q_proj(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_BSDh, sin_BSDh), apply_rotary(k, cos_BSDh, sin_BSDh)
        dropout = self.dropout if self.training else 0.0
        call = sink_attention
        if (shard := self.attention_call) is not None:  # sequence parallel: on this rank's heads of the whole row
            call = dataclasses.replace(shard, attn_fn=functools.partial(_sinks_on_head_shard, group=shard.group))
        out_BHSDh = call(q, k, v, masks[self.layer_type], self.sinks, self.head_dim**-0.5, dropout)
        return self.o_proj(out_BHSDh.transpose(1, 2).reshape(b, s, -1))

    def extra_repr(self) -> str:
        return f"{self.layer_type}, window={self.sliding_window}"
