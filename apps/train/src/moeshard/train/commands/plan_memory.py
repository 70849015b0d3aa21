"""The memory model of ``moeshard-train plan``: the bytes per rank a step holds at its peak (:class:`MemoryEstimate`),
the activations a training micro-batch saves per token (:func:`activation_bytes_per_token`), what the chunked loss
head holds (:func:`loss_head_bytes`), and the report's memory lines. ``plan_build.py`` builds the job on meta and fills
them in."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from moeshard.ep import backward_elements
from moeshard.models.common import LOSS_CHUNK_TOKENS
from moeshard.train.families import family_of

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; ``total`` is what to compare with the peak allocated memory."""

    params: int
    grads: int
    optimizer: int
    unsharded: int
    activations: int
    micro_batches: int = 1
    held_grads: int = 0
    loss_head: int = 0
    reduce_buffers: int = 0
    loss_head_adds: bool = False  # the head adds its weight gradient into a held one in backward (loss_head_bytes)
    loss_head_over_logits: bool = False  # a chunk's logit gradient is written over its logits (loss_head_bytes)
    first_layer: int = 0  # activations while the first decoder layer runs backward (its own, the gradient flowing)
    late_grads: int = 0  # gradients formed by then: all but the first stage's (the embedding's, formed last)
    late_reduce_buffers: int = 0  # a decoder block's reduce buffers (the largest), in flight by then

    @property
    def backward_start(self) -> int:
        """Beyond the parameters, optimizer state and compute copies, what the backward's first layer holds: all
        that forward saved (``activations``) and the loss head's (``loss_head``); no gradient yet but the head's,
        which ``loss_head`` counts."""
        return self.activations + self.loss_head

    @property
    def backward_end(self) -> int:
        """The same at the backward's other end (one micro-batch): the first decoder layer's activations and
        working set (``first_layer``) beside every gradient formed after it (``late_grads``: the later layers',
        the head's) and a block's reduce buffers; or, once backward is over, every gradient and the largest
        stage's reduce buffers. Gradients are never freed within a step: ``zero_grad`` drops them at the next."""
        late = self.first_layer + self.late_grads + self.late_reduce_buffers
        return max(late, self.grads + self.reduce_buffers)

    @property
    def total(self) -> int:
        """The peak. Backward runs the layers from the last to the first: each frees what its forward saved and
        keeps the gradients it forms, so what is alive moves linearly from one end (:attr:`backward_start`) to the
        other (:attr:`backward_end`), and the peak is at one of them. With several micro-batches per step, the
        gradients of the earlier ones are alive beside the last one's activations, and with
        ``train.gradient_sync: last_micro_batch`` also FSDP's unsharded float32 gradients (``held_grads``).
        (How close this comes to the measured peaks, per regime: docs/performance.md.)"""
        base = self.params + self.optimizer + self.unsharded
        if self.micro_batches > 1:
            return base + self.grads + self.held_grads + max(self.backward_start, self.reduce_buffers)
        return base + max(self.backward_start, self.backward_end)


def _size(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:8.2f} MiB"


def activation_bytes_per_token(
    config: Any,
    compute_bytes: int,
    activation_checkpointing: str = "none",
    selective_recompute: str = "activation",
    keep_attention: bool = False,
    *,
    dispatch: str = "overlapped",
    ep_size: int = 1,
    lowrank_experts: bool = False,
    first_layer: bool = False,
) -> int:
    """Saved activations per token of one training micro-batch, all layers + the loss head, and the working set of
    the one layer whose backward runs at the peak.

    Without activation checkpointing every layer keeps its activations; with ``full``, each layer keeps only its
    input (and with ``keep_attention`` what the family's layer keeps, ``ModelFacts.kept_attention``:
    the attention's output and log-sum-exp, the output projection's output; packed rows recompute the attention, so
    there the estimate is high by the attention's part) and one layer at a time is recomputed in backward; with
    ``selective`` every layer keeps its activations but the routed copies' gated activation (``activation``: ``F``
    elements per copy) or also their gate/up output (``mlp``: ``3F``). A routed copy keeps ``D + 3F``: its row into
    the experts, the gate/up output and the gated activation (the expert pass applies the routing weight, so nothing
    of its output is kept for that gradient).
    The loss head is chunked (the trainer never holds the ``[tokens, vocab]`` logits): per token it keeps the
    hidden states and their gradient (its ``[V, D]`` weight gradient and one chunk's logits are
    :func:`loss_head_bytes`). Each layer's sequence mixer counts its own (``ModelFacts.mixer_activations``: a model
    whose layers mix attention and a linear attention), and a recurrent mixer's per-chunk states (the largest
    layer's, ``ModelFacts.recurrent_state``) are added once: one layer holds them while it runs.
    Once, too, what the MoE layer in backward holds beyond its saved tensors while its expert pass forms the copies'
    gradients (the EP dispatcher's report, ``moeshard.ep.backward_elements`` for ``dispatch`` at ``ep_size``;
    ``lowrank_experts``: LoRA's adapters on the expert weights), in every regime: it is alive beside all that the
    other layers keep.
    ``first_layer``: what is alive while the first decoder layer runs backward instead (the other layers' saved
    tensors freed): that layer's as above (its attention counted as the first MoE layer's), its working set and the
    gradient into its output (the loss head's input is freed by then).
    """
    facts = family_of(config).facts(config)  # derived from the family's model, whatever its config calls things
    d, e, k, f = facts.hidden_size, facts.num_experts, facts.top_k, facts.expert_width
    attn_elems, mlp_elems = facts.attention_activations, facts.mlp_activations  # the attention, shared experts
    mixer = compute_bytes * 4 * d + 4 * facts.attention_heads  # norms, projections, sdpa lse (the mixer's own below)
    attn = mixer + compute_bytes * attn_elems  # the first MoE layer's, for the one layer recomputed at a time
    state = compute_bytes * facts.recurrent_state
    moe = compute_bytes * (2 * d + k * (d + 3 * f) + mlp_elems) + 4 * (2 * e + 3 * k)  # dispatch ... router
    if activation_checkpointing == "selective":
        moe -= compute_bytes * k * (f if selective_recompute == "activation" else 3 * f)
    head = 2 * d * compute_bytes
    # one MoE layer's backward working set (per token: top_k routed copies), added once as the recompute is
    if k:
        state += int(compute_bytes * backward_elements(dispatch, ep_size, k, d, f, lowrank=lowrank_experts))
    layers = 1 if first_layer else config.num_hidden_layers
    if first_layer:  # the loss head's input is freed by then; the gradient into the layer's output is not
        head = d * compute_bytes
    if activation_checkpointing == "full":
        kept_elems, kept_floats = facts.kept_attention if keep_attention else (0, 0)
        return layers * ((d + kept_elems) * compute_bytes + 4 * kept_floats) + (attn + moe) + state + head
    if first_layer:
        return attn + moe + state + head
    return layers * (mixer + moe) + compute_bytes * facts.mixer_activations + state + head


def adapter_activation_bytes_per_token(
    adapters: Any, layers: int, compute_bytes: int, activation_checkpointing: str = "none"
) -> int:
    """What LoRA's adapters (``moeshard.lora.LoraAdapters``) add to the saved activations per token, beside
    :func:`activation_bytes_per_token` (which the frozen base keeps as the trained one does).

    A targeted linear module keeps its rank-``r`` intermediate ``x Aᵀ`` (``r`` elements per token in the compute
    dtype, for ``B``'s gradient; ``x`` is the base's own saved input); with ``lora.dropout`` also its dropped input
    (``in`` elements, for ``A``'s gradient) and the dropout's mask (``in`` bytes). A targeted fused expert tensor keeps
    nothing per routed copy: the expert pass recomputes its ``x Aᵀ`` in backward (``moeshard.ep.ExpertPass``). With
    ``full`` activation checkpointing only the layer recomputed in backward holds them (the one that keeps the most),
    and the targets outside the decoder layers always.
    """
    r, dropout = adapters.options.rank, adapters.options.dropout
    per_layer: Counter[str] = Counter()
    outside = 0
    for t in adapters.targets:
        if t.kind != "linear":
            continue
        kept = r * compute_bytes + (adapters.shapes[t.a_name][-1] * (compute_bytes + 1) if dropout else 0)
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", t.module)
        if m is None:
            outside += kept
        else:
            per_layer[m.group(1)] += kept
    assert len(per_layer) <= layers, (len(per_layer), layers)
    in_layers = max(per_layer.values(), default=0) if activation_checkpointing == "full" else sum(per_layer.values())
    return in_layers + outside


def loss_head_bytes(
    config: Any,
    compute_bytes: int,
    tokens: int,
    held: bool = False,
    over_logits: bool = False,
    head_trains: bool = True,
) -> int:
    """What the chunked loss head (``moeshard.models.common.linear_cross_entropy``) holds at the forward's end
    beyond the per-token activations: the ``[V, D]`` weight gradient it computes in forward and keeps for backward
    (float32: it is handed to FSDP2's float32 gradient, or kept in float32 compute), and one chunk's logits and
    their gradient (``2 x chunk x V`` in the compute dtype) while the last chunk's loss is computed.

    ``held``: FSDP2 holds the head's float32 gradient from an earlier micro-batch (several micro-batches with
    ``gradient_sync: last_micro_batch``). A bf16 micro-batch of one chunk then keeps its logit gradient for backward,
    which adds its product into the held gradient, and makes no ``[V, D]`` float32 gradient of its own.
    ``over_logits``: the loss kernel writes the gradient over the logits (:func:`loss_head_over_logits`), one
    ``chunk x V`` buffer instead of two. ``head_trains`` False (a frozen head, lora): no weight gradient at all."""
    v, d = config.vocab_size, config.hidden_size
    chunk = (1 if over_logits else 2) * min(LOSS_CHUNK_TOKENS, tokens) * v * compute_bytes
    if not head_trains or head_adds_in_backward(compute_bytes, tokens, held):
        return chunk
    return 4 * v * d + chunk


def loss_head_over_logits(opts: Any, compute_bytes: int) -> bool:
    """Whether the head's loss chunk writes its gradient over its logits: the triton tier's kernel
    (``moeshard.models.common.ce_chunk_triton_``), which ``parallelize`` gives the head with ``compile`` on CUDA
    (bf16 compute)."""
    return bool(opts.compile) and opts.ep.kernels == "triton" and compute_bytes == 2


def head_adds_in_backward(compute_bytes: int, tokens: int, held: bool) -> bool:
    """Whether the loss head's micro-batch keeps its logit gradient and adds its weight-gradient product into the
    float32 gradient FSDP2 holds (see :func:`loss_head_bytes`): bf16 compute, one chunk, a gradient held."""
    return held and compute_bytes == 2 and tokens <= LOSS_CHUNK_TOKENS


def memory_lines(
    est: MemoryEstimate,
    opts: Any,
    mb: int,
    seq_len: int,
    compute_bytes: int,
    expert_reduce_bytes: int,
    *,
    lora: bool = False,
) -> list[str]:
    """The memory estimate's lines of the report (``lora``: the base frozen, the adapters trained)."""
    lines: list[str] = []
    ac = {"none": "no", "full": "full", "selective": f"selective ({opts.selective_recompute})"}
    ac = ac[opts.activation_checkpointing]
    dtype = "bf16" if compute_bytes == 2 else "fp32"
    trained = (
        f"LoRA: the base frozen in {dtype}, fp32 adapter masters, AdamW on the adapters"
        if lora
        else "fp32 master weights, AdamW"
    )
    lines.append(
        f"estimated memory per rank (micro batch {mb} x seq {seq_len}"
        + (f" / sp {opts.sp_size}" if opts.sp_size > 1 else "")
        + f" x {est.micro_batches} per step, "
        f"{ac} activation checkpointing, {dtype} compute, {trained}):"
    )
    for k in ("params", "grads", "optimizer", "unsharded", "activations"):
        lines.append(f"  {k:12s} {_size(getattr(est, k))}")
    over = est.loss_head_over_logits
    chunk = "one chunk's logit gradient, over its logits" if over else "one chunk's logits and their gradient"
    if est.loss_head_adds:
        kept = f"{chunk}, its product added into the held gradient in backward"
    elif lora:
        kept = f"{chunk}; the frozen head has no weight gradient"
    else:
        kept = f"[V, D] float32 weight gradient, {chunk}"
    lines.append(f"  {'loss head':12s} {_size(est.loss_head)}  ({kept})")
    lines.append(f"  {'reduce bufs':12s} {_size(est.reduce_buffers)}  (the largest stage's, in backward)")
    if est.held_grads and est.micro_batches > 1:
        dtype = "fp32" if expert_reduce_bytes == 4 else "fp32, experts' bf16"
        lines.append(
            f"  {'held grads':12s} {_size(est.held_grads)}  (gradient_sync last_micro_batch: unsharded {dtype})"
        )
    held = "alive together" if est.micro_batches > 1 else "not alive together"
    lines.append(f"  {'total':12s} {_size(est.total)}  (peak: activations and gradients are {held})")
    return lines
