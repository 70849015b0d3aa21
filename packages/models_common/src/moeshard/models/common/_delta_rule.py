"""Linear-attention kernels any family's sequence mixer can use: the gated delta rule and the short causal
convolution in front of it, each restarting at every document of a packed row.

A plain torch reference (chunked, the algorithm of transformers' ``torch_chunk_gated_delta_rule``) runs on any
device and is what the CPU tests compare; on CUDA :func:`linear_attention_kernels` gives flash-linear-attention's
Triton kernels (the optional ``fla-core`` / ``flash-linear-attention`` package) with ``cu_seqlens`` for packed rows.

Legend: B batch, S sequence, T = B·S flattened tokens, H value heads, Hk key heads, Dk / Dv key / value head
size, C channels of the convolution, K its kernel width, N segments (documents of all rows).

    S_t = exp(g_t) · S_{t-1} · (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ        o_t = S_t q_t / sqrt(Dk)

with q and k L2-normalised per head. Documents: the state starts from zero at each document's first token and the
convolution sees no token of an earlier document (:class:`RowSegments`).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshard.models.common._sequence_layout import SequenceLayout

__all__ = [
    "DELTA_RULE_CHUNK",
    "LinearAttentionKernels",
    "RowSegments",
    "causal_conv1d_reference",
    "chunk_gated_delta_rule_reference",
    "delta_rule_flops_per_token",
    "linear_attention_kernels",
    "linear_attention_row",
]

DELTA_RULE_CHUNK = 64
"""Tokens per chunk of the chunked gated delta rule (the reference's and flash-linear-attention's)."""


@dataclass(frozen=True)
class RowSegments:
    """What a mixer that carries state along a row needs to know of it: ``document_ids_BS`` (packed rows; None: one
    document per row) and ``attention_mask_BS`` (1 tokens, 0 padding; None: no padding). The decoder gives it to
    the mixers whose ``mask_kind`` is ``"segments"`` instead of an attention mask."""

    document_ids_BS: torch.Tensor | None = None
    attention_mask_BS: torch.Tensor | None = None
    sequence: SequenceLayout = SequenceLayout()
    """Under sequence parallelism the decoder's layout: this rank holds the row's tokens ``[rank·s, (rank+1)·s)``
    (the two masks are the whole row's)."""

    @property
    def sequence_rank(self) -> int:
        """This rank's place in its sequence group (``sequence.rank``)."""
        return self.sequence.rank

    def local_attention_mask(self, s: int) -> torch.Tensor | None:
        """The padding mask of this rank's ``s`` tokens (None: no padding)."""
        mask = self.attention_mask_BS
        if mask is None or mask.shape[-1] == s:
            return mask
        return self.sequence.local(mask, s)

    def cu_seqlens(self, b: int, s: int, device: torch.device) -> torch.Tensor | None:
        """int32 ``[N + 1]`` starts of the segments of the flattened ``[B·S]`` tokens (each row starts one, so does
        each change of document id), or None where every row is one segment."""
        if self.document_ids_BS is None:
            return None
        doc_BS = self.document_ids_BS.to(device)
        starts_BS = torch.ones(b, s, dtype=torch.bool, device=device)
        starts_BS[:, 1:] = doc_BS[:, 1:] != doc_BS[:, :-1]
        starts_T = starts_BS.reshape(-1).nonzero().squeeze(-1)
        return F.pad(starts_T, (0, 1), value=b * s).to(torch.int32)


def causal_conv1d_reference(
    x_BSC: torch.Tensor, weight_CK: torch.Tensor, document_ids_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu`` of the depthwise causal convolution of ``x`` (``y_t = Σ_j w_j · x_{t-K+1+j}``, earlier tokens
    zero), in ``x``'s dtype. With ``document_ids_BS`` a token sees only the earlier tokens of its document."""
    s, k = x_BSC.shape[1], weight_CK.shape[1]
    x_BCS = x_BSC.transpose(1, 2).to(weight_CK.dtype)
    if document_ids_BS is None:  # transformers' own call, so the numbers are the same
        y_BCS = F.conv1d(x_BCS, weight_CK.unsqueeze(1), padding=k - 1, groups=x_BCS.shape[1])[..., :s]
        return F.silu(y_BCS).transpose(1, 2).to(x_BSC.dtype)
    doc_BS = document_ids_BS.to(x_BSC.device)
    y_BSC = torch.zeros_like(x_BSC, dtype=weight_CK.dtype)
    xw_BSC = x_BCS.transpose(1, 2)
    for shift in range(min(k, s)):  # tap k-1-shift reads the token `shift` back, where it is of the same document
        same_BS = torch.ones_like(doc_BS, dtype=torch.bool)
        if shift:
            same_BS = F.pad(doc_BS[:, shift:] == doc_BS[:, :-shift], (shift, 0), value=False)
        back_BSC = F.pad(xw_BSC, (0, 0, shift, 0))[:, :s]
        y_BSC = y_BSC + torch.where(same_BS[..., None], back_BSC, 0.0) * weight_CK[:, k - 1 - shift]
    return F.silu(y_BSC).to(x_BSC.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _chunk_rule(q, k, v, g, beta, chunk: int) -> torch.Tensor:
    """One batch of independent rows, ``[B, H, S, D]`` float32 (q, k normalised and scaled); ``[B, H, S, Dv]``."""
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - s % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (s + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(b, h, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # the UT transform's lower-triangular system
    intra = (q @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    state = q.new_zeros(b, h, dk, dv)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(b, h, -1, dv)[:, :, :s]


def chunk_gated_delta_rule_reference(
    q_BSHkDk: torch.Tensor,
    k_BSHkDk: torch.Tensor,
    v_BSHDv: torch.Tensor,
    g_BSH: torch.Tensor,
    beta_BSH: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk: int = DELTA_RULE_CHUNK,
) -> torch.Tensor:
    """The gated delta rule (module docstring) over each row, or over each segment of the flattened rows where
    ``cu_seqlens`` (:meth:`RowSegments.cu_seqlens`) is given; ``[B, S, H, Dv]`` in ``q``'s dtype, computed in
    float32. Each key head serves ``H / Hk`` consecutive value heads."""
    b, s, hk, _ = k_BSHkDk.shape
    h = v_BSHDv.shape[2]
    q, k = q_BSHkDk, k_BSHkDk
    if h != hk:
        q, k = q.repeat_interleave(h // hk, dim=2), k.repeat_interleave(h // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v_BSHDv, beta_BSH, g_BSH))
    q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if cu_seqlens is None:
        out_BHSDv = _chunk_rule(q, k, v, g, beta, chunk)
    else:  # each segment alone: the state restarts at zero (flattened rows, as the varlen kernels take them)
        flat = [x.transpose(0, 1).reshape(h, b * s, *x.shape[3:])[None] for x in (q, k, v, g, beta)]
        bounds = cu_seqlens.tolist()
        parts = [_chunk_rule(*(x[:, :, a:e] for x in flat), chunk) for a, e in zip(bounds[:-1], bounds[1:])]
        out_BHSDv = torch.cat(parts, dim=2)[0].reshape(h, b, s, -1).transpose(0, 1)
    return out_BHSDv.transpose(1, 2).to(q_BSHkDk.dtype)


def delta_rule_flops_per_token(heads: int, key_dim: int, value_dim: int, chunk: int = DELTA_RULE_CHUNK) -> int:
    """Forward FLOPs per token of the chunked gated delta rule, ``2 · H · (C · (3·Dk + 2·Dv) + 3 · Dk · Dv)``:
    within a chunk of C tokens the ``k_β·kᵀ`` and ``q·kᵀ`` products and the two triangular solves
    (``C · (2·Dk + Dk + Dv)``) and the intra-chunk read ``C · Dv``; against the state the reads by ``w`` and ``q``
    and the update (``3 · Dk · Dv``)."""
    return 2 * heads * (chunk * (3 * key_dim + 2 * value_dim) + 3 * key_dim * value_dim)


@dataclass(frozen=True)
class LinearAttentionKernels:
    """The convolution and the delta rule a mixer runs, both taking the flattened segments ``cu_seqlens``."""

    name: str
    conv: object
    delta_rule: object


def _reference_kernels() -> LinearAttentionKernels:
    def conv(x_BSC, weight_CK, segments: RowSegments):
        return causal_conv1d_reference(x_BSC, weight_CK, segments.document_ids_BS)

    def rule(q, k, v, g, beta, cu_seqlens):
        return chunk_gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens)

    return LinearAttentionKernels("torch", conv, rule)


def _fla_kernels() -> LinearAttentionKernels:
    """flash-linear-attention 0.6's kernels (``fla.modules.causal_conv1d.causal_conv1d``,
    ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``): ``[B, T, heads, D]`` rows, or with ``cu_seqlens`` (int64
    ``[N + 1]``, its documented type) one row of the flattened segments."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def conv(x_BSC, weight_CK, segments: RowSegments):
        b, s, c = x_BSC.shape
        cu = segments.cu_seqlens(b, s, x_BSC.device)
        if cu is not None:  # varlen kernels take rows flattened
            x_BSC, cu = x_BSC.reshape(1, b * s, c), cu.long()
        # weight [C, K], tap j on x_{t-K+1+j} as F.conv1d's (the reference's); silu applied in the kernel
        y, _ = causal_conv1d(x_BSC, weight=weight_CK, activation="silu", cu_seqlens=cu)
        return y.reshape(b, s, c)

    def rule(q, k, v, g, beta, cu_seqlens):
        b, s = g.shape[:2]
        if cu_seqlens is not None:
            q, k, v, g, beta = (x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta))
            cu_seqlens = cu_seqlens.long()
        # q, k keep their Hk key heads: the kernel's grouped values read key head i // (H / Hk) for value head i,
        # the reference's repeat_interleave, without the copies. g in log space (float32), β after its sigmoid.
        out, _ = chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=q.shape[-1] ** -0.5,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
        )
        return out.reshape(b, s, *out.shape[2:])

    return LinearAttentionKernels("fla", conv, rule)


def fla_platform_defect(capability: tuple[int, int], triton_version: str, has_tilelang: bool) -> str | None:
    """Why flash-linear-attention 0.6 cannot train a Gated DeltaNet on this platform, or None: on Hopper GPUs
    (compute capability 9.x) with triton at least 3.4.0 and below 3.7.1 the gated delta rule's backward gives wrong
    results, and fla itself refuses it there unless its tilelang backend is installed."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", triton_version)
    version = tuple(int(x or 0) for x in found.groups()) if found else (0, 0, 0)
    if capability[0] != 9 or not (3, 4, 0) <= version < (3, 7, 1) or has_tilelang:
        return None
    return (
        f"flash-linear-attention's gated delta rule backward gives wrong results on Hopper GPUs with triton "
        f"{triton_version} (fla refuses it there): install triton>=3.7.1 or tilelang (pip install tilelang), or set "
        "the Gated DeltaNet's kernel to 'torch' (slow)"
    )


@functools.cache  # asked at every DeltaNet forward: find the facts once per device, not a sys.path scan per layer
def _platform_defect(device: torch.device) -> str | None:
    import triton

    has_tilelang = importlib.util.find_spec("tilelang") is not None
    return fla_platform_defect(torch.cuda.get_device_capability(device), triton.__version__, has_tilelang)


def linear_attention_kernels(kernel: str, device: torch.device) -> LinearAttentionKernels:
    """The kernels of ``kernel`` (``"auto"``: flash-linear-attention's on CUDA, the torch reference elsewhere;
    ``"fla"``; ``"torch"``) for ``device``.

    Raises:
        ValueError: an unknown kernel, or flash-linear-attention asked for (or ``"auto"`` on CUDA) where it is not
            installed, the device is not CUDA, or its backward is known to be wrong (:func:`fla_platform_defect`).
    """
    if kernel not in ("auto", "fla", "torch"):
        raise ValueError(f"linear attention kernel {kernel!r} is not one of 'auto', 'fla', 'torch'")
    if kernel == "torch" or (kernel == "auto" and device.type != "cuda"):
        return _reference_kernels()
    if device.type != "cuda":
        raise ValueError(f"linear attention kernel 'fla' needs a CUDA device, got {device}; use 'torch' or 'auto'")
    try:
        kernels = _fla_kernels()
    except ImportError as err:
        raise ValueError(
            f"linear attention on GPU needs flash-linear-attention ({err}): install the model family's 'kernels' "
            "extra (or pip install 'flash-linear-attention>=0.6'), or set the mixers' kernel to 'torch' (slow)"
        ) from None
    defect = _platform_defect(device)
    if defect is not None:
        raise ValueError(defect)
    return kernels


def linear_attention_row(
    q_BSGDk: torch.Tensor,
    k_BSGDk: torch.Tensor,
    v_BSHDv: torch.Tensor,
    g_BSH: torch.Tensor,
    beta_BSH: torch.Tensor,
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    segments: RowSegments,
    kernels: LinearAttentionKernels,
) -> torch.Tensor:
    """A Gated DeltaNet's work along the whole row for the heads it is given: the short causal convolution (with its
    silu) of the projected ``q``, ``k``, ``v``, then the chunked gated delta rule with ``g`` (log-space decay) and
    ``beta``; ``[B, S, H, Dv]``. ``conv_weights``: the convolution's per-head weights ``([G, Dk, K], [G, Dk, K],
    [H, Dv, K])`` of q, k and v (the channels are per head, so a subset of heads is a subset of channels). Each of the
    ``G`` key heads serves ``H / G`` consecutive value heads. Under sequence parallelism this call runs on head
    shards (``apply_sequence_parallel``)."""
    b, s = g_BSH.shape[:2]
    parts = (q_BSGDk, k_BSGDk, v_BSHDv)
    x_BSC = torch.cat([t.reshape(b, s, -1) for t in parts], dim=-1)
    weight_CK = torch.cat([w.reshape(-1, w.shape[-1]) for w in conv_weights])
    y_BSC = kernels.conv(x_BSC, weight_CK, segments)
    q, k, v = torch.split(y_BSC, [t.shape[2] * t.shape[3] for t in parts], dim=-1)
    return kernels.delta_rule(
        *(x.reshape(t.shape) for x, t in zip((q, k, v), parts)),
        g_BSH,
        beta_BSH,
        segments.cu_seqlens(b, s, x_BSC.device),
    )
