"""A family's facts (parameter counts, FLOPs per token, activation sizes, the MoE shapes) derived from its model.

The causal LM is built on the meta device (no memory, no init), so one computation serves every family: adding a
family writes no formula. What the module tree cannot say, the attention modules declare as attributes:
``num_heads`` and ``num_kv_heads`` (the heads of the queries and of the keys the attention kernel reads) and
``qk_head_dim`` / ``v_head_dim`` (head sizes of ``q·k`` and of the values; MLA's differ). A sequence mixer whose
cost per token does not grow with the sequence (a linear attention: a recurrent state instead of the keys) declares
them too (its value heads, key heads, key and value head sizes) and ``recurrent_flops_per_token``, the forward
FLOPs per token of its state work (not counted as attention); for memory ``recurrent_activations_per_token``, the
elements per token its state work keeps for backward beside its modules' outputs (in place of attention's query and
keys), and ``recurrent_state_per_token``, the elements per token of the per-chunk states it materialises while it runs
(one layer's at a time). An attention that sees at most the last ``w`` keys (a sliding window) declares
``attention_window = w`` (None or absent: every earlier key).

    facts = model_facts(Qwen3MoeForCausalLM, config)
    facts.parameters, facts.active_parameters, facts.flops_per_token(4096), facts.expert_width

Counting rules (each is the family's model, not its config's field names):

- parameters: every tensor a checkpoint holds, parameters and persistent buffers (DeepSeek-V3's router
  correction bias is a stored buffer).
- active parameters: all of them but the routed experts, of which each token uses ``top_k / num_experts``.
- matmul parameters per token: the weights with two or more dims outside embedding lookups (the LM head is a
  matmul, the token embedding is not), routed experts scaled by ``top_k / num_experts`` as above.
- FLOPs per token (training): ``6 · matmul parameters + 6 · Σ_attention layers keys(S, w) · H · (Dqk + Dv) + 3 ·
  Σ_recurrent layers recurrent_flops_per_token``: causal attention's score and value products over the keys a
  query sees on average, ``keys = S/2`` without a window and, with a window of ``w`` keys, the mean of
  ``min(position, w)``: ``S/2`` while ``S <= w``, else ``w - w²/(2S)`` (``w`` for ``S >> w``); a recurrent mixer's
  state work, forward and twice that backward.
- activations per token of one MoE layer (an estimate for planning memory, beside the layer norms and routed
  copies the planner counts itself): for the attention and for the MoE block's other modules (shared experts),
  each leaf module's output but the block's last one's, the last one's input (each is what the op after it keeps
  for backward), and for the attention the query and keys its kernel reads (rotated copies, new tensors), for a
  recurrent mixer its declared ``recurrent_activations_per_token``. Models whose layers mix both kinds sum each
  layer's own mixer (``mixer_activations``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from moeshard.models.common._moe import Experts, MoEBlock, Router

__all__ = ["ATTENTION_ATTRIBUTES", "ModelFacts", "model_facts"]

ATTENTION_ATTRIBUTES = ("num_heads", "num_kv_heads", "qk_head_dim", "v_head_dim")
"""What every family's attention module declares for :meth:`ModelFamily.facts` (ints)."""

_TOKENS = 2  # tokens of the meta forward that measures per-token sizes (any count gives the same widths)


@dataclass(frozen=True)
class ModelFacts:
    """What a trainer needs to know of a model, derived from it by :meth:`ModelFamily.facts` (never from field names).

    Attributes:
        parameters: all parameters (and stored buffers) of the causal LM.
        active_parameters: those one token touches: all but the routed experts, ``top_k`` of those per MoE layer.
        matmul_parameters: weights a token passes through in matmuls (the LM head, not the embedding lookup),
            routed experts counted ``top_k`` per MoE layer.
        attention_width: ``Σ_layers heads · (qk_head_dim + v_head_dim)`` over the attention layers without a
            window: causal attention's FLOPs per key.
        layers: decoder layers.
        moe_layers: decoder layers with routed experts.
        hidden_size: the model's width ``D``.
        num_experts: routed experts per MoE layer ``E`` (of the first MoE layer; 0 without one, as ``top_k`` and
            ``expert_width``).
        top_k: routed experts per token ``K``.
        expert_width: one routed expert's intermediate width ``F``.
        attention_heads: the attention's query heads ``H`` (of the first layer).
        attention_activations: elements per token the attention of the first MoE layer keeps for backward (see the
            module docstring).
        mlp_activations: elements per token the MoE block's modules other than the routed experts and the router
            keep for backward (shared experts; 0 where there are none).
        recurrent_flops: ``Σ`` of the recurrent mixers' ``recurrent_flops_per_token`` (forward FLOPs per token of
            their state work; 0 without such layers).
        mixer_activations: ``Σ_layers`` of each layer's sequence mixer's activations per token, counted as
            ``attention_activations`` is (``layers · attention_activations`` where every layer has the same mixer).
        recurrent_state: the largest ``recurrent_state_per_token`` of the recurrent mixers (elements per token of the
            per-chunk states one layer materialises while it runs forward or backward; 0 without such layers).
        kept_attention: ``(compute-dtype, float32)`` elements per token and layer that full activation
            checkpointing keeps beside the layer's input where it keeps the attention's output: the output and its
            log-sum-exp where the kept kernels apply (one head size for q, k and v), and the output projection's
            output; only the latter otherwise.
        windowed_attention: ``(window, heads · (qk_head_dim + v_head_dim))`` of each attention layer that sees at
            most ``window`` keys (its ``attention_window``); empty without such layers.
    """

    parameters: int
    active_parameters: int
    matmul_parameters: int
    attention_width: int
    layers: int
    moe_layers: int
    hidden_size: int
    num_experts: int
    top_k: int
    expert_width: int
    attention_heads: int
    attention_activations: int
    mlp_activations: int
    kept_attention: tuple[int, int]
    recurrent_flops: int = 0
    windowed_attention: tuple[tuple[int, int], ...] = ()
    mixer_activations: int = 0
    recurrent_state: int = 0

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward) at ``seq_len`` with causal attention:
        ``6 · matmul_parameters + 6 · (seq_len / 2) · attention_width + 6 · Σ_windowed keys(seq_len, window) · width
        + 3 · recurrent_flops`` (:func:`window_keys`)."""
        windowed = sum(window_keys(seq_len, w) * width for w, width in self.windowed_attention)
        return (
            6 * self.matmul_parameters
            + 6 * (seq_len / 2) * self.attention_width
            + 6 * windowed
            + 3 * self.recurrent_flops
        )


def window_keys(seq_len: int, window: int) -> float:
    """The keys a query of a causal row of ``seq_len`` tokens sees on average under a window of ``window`` keys, in
    the full attention's ``S/2`` convention: the mean of ``min(position, window)`` over ``[0, seq_len]``,
    ``seq_len / 2`` while ``seq_len <= window``, else ``window - window² / (2 · seq_len)``."""
    if seq_len <= window:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def model_facts(model_class: type[nn.Module], config: PretrainedConfig) -> ModelFacts:
    """The :class:`ModelFacts` of ``model_class(config)`` (a ``MoECausalLM``), built on the meta device; the facts of
    a config already seen (its values, compared as JSON) are reused, as the model it builds is the same.

    Raises:
        ValueError: the config is refused by the model (its family's check), or the model's attention does not
            declare :data:`ATTENTION_ATTRIBUTES`.

    Example::

        facts = model_facts(DeepseekV3ForCausalLM, get_preset_config("deepseek-v3-16b"))
        facts.active_parameters, facts.flops_per_token(4096)
    """
    try:
        key = (model_class, config.to_json_string(use_diff=False))
    except (TypeError, ValueError):  # a value JSON cannot hold: derive them again
        return _build_facts(model_class, config)
    if key not in _SEEN:
        while len(_SEEN) >= _SEEN_MAX:
            _SEEN.pop(next(iter(_SEEN)))
        _SEEN[key] = _build_facts(model_class, config)
    return _SEEN[key]


_SEEN: dict[tuple[type, str], ModelFacts] = {}
_SEEN_MAX = 64


def _build_facts(model_class: type[nn.Module], config: PretrainedConfig) -> ModelFacts:
    with torch.device("meta"):
        model = model_class(config)
    layers = list(model.model.layers)
    blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]
    routed = sum(_numel(b.experts) for b in blocks)
    routed_active = sum(_numel(b.experts) // b.experts.num_experts * b.gate.top_k for b in blocks)
    stored = sum(t.numel() for t in model.state_dict().values())
    matmul = routed_active + sum(
        p.numel()
        for m in model.modules()
        if not isinstance(m, (Experts, nn.Embedding))
        for p in m.parameters(recurse=False)
        if p.dim() >= 2
    )
    mixers = [layer.mixer for layer in layers]
    attentions = [_attention_dims(m) for m in mixers]
    recurrent = [getattr(m, "recurrent_flops_per_token", None) for m in mixers]
    windows = [_window(m) for m in mixers]
    # Activations of an MoE layer (what the planner multiplies by the layers); a model without one: its first layer.
    i = next((i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoEBlock)), 0)
    heads, kv_heads, qk, v = attentions[i]
    d = model.lm_head.weight.shape[1]
    measured: dict[tuple, tuple[int, int]] = {}  # layers of one kind measure alike: once per kind
    per_layer = []
    for m, dims in zip(mixers, attentions):
        kind = _module_kind(m)
        if kind not in measured:
            measured[kind] = _mixer_activations(model, m, d, dims)
        per_layer.append(measured[kind])
    attn_elems, out_width = per_layer[i]
    mlp_elems, num_experts, top_k, width = 0, 0, 0, 0
    if blocks:
        first = blocks[0]
        # the block's other children (shared experts): neither the routed experts nor the router, whatever its name
        others = [m for name, m in first.named_children() if name != "experts" and not isinstance(m, Router)]
        mlp_elems = sum(_block_activations(m, torch.empty(1, _TOKENS, d))[0] for m in others)
        num_experts, top_k, width = first.experts.num_experts, first.gate.top_k, first.experts.down_proj.shape[2]
    kept = (heads * v + out_width, heads) if qk == v else (out_width, 0)
    return ModelFacts(
        parameters=stored,
        active_parameters=stored - routed + routed_active,
        matmul_parameters=matmul,
        attention_width=sum(
            h * (q + w) for (h, _, q, w), r, win in zip(attentions, recurrent, windows) if r is None and win is None
        ),
        layers=len(layers),
        moe_layers=len(blocks),
        hidden_size=d,
        num_experts=num_experts,
        top_k=top_k,
        expert_width=width,
        attention_heads=attentions[0][0],
        attention_activations=attn_elems,
        mlp_activations=mlp_elems,
        kept_attention=kept,
        recurrent_flops=sum(int(r) for r in recurrent if r is not None),
        windowed_attention=tuple(
            (win, h * (q + w)) for (h, _, q, w), r, win in zip(attentions, recurrent, windows) if r is None and win
        ),
        mixer_activations=sum(elems for elems, _ in per_layer),
        recurrent_state=max((int(getattr(m, "recurrent_state_per_token", 0)) for m in mixers), default=0),
    )


def _module_kind(module: nn.Module) -> tuple:
    """What decides a module's meta forward: the class and the plain attributes of it and its submodules, and
    their tensors' shapes (two layers equal in these run the same ops on the same shapes)."""
    return tuple(
        (
            name,
            type(m),
            tuple((k, v) for k, v in sorted(vars(m).items()) if isinstance(v, (bool, int, float, str, type(None)))),
            tuple(
                (k, tuple(t.shape), t.dtype)
                for k, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
            ),
        )
        for name, m in module.named_modules()
    )


def _window(attn: nn.Module) -> int | None:
    window = getattr(attn, "attention_window", None)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{type(attn).__name__}.attention_window={window!r}: declare a positive int, or None")
    return window


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _attention_dims(attn: nn.Module) -> tuple[int, int, int, int]:
    missing = [a for a in ATTENTION_ATTRIBUTES if not isinstance(getattr(attn, a, None), int)]
    if missing:
        raise ValueError(
            f"{type(attn).__name__} does not declare {', '.join(missing)}: set them (ints) in its __init__, as "
            "ModelFamily.facts reads them"
        )
    return tuple(int(getattr(attn, a)) for a in ATTENTION_ATTRIBUTES)  # type: ignore[return-value]


def _mixer_activations(model: nn.Module, mixer: nn.Module, d: int, dims: tuple[int, int, int, int]) -> tuple[int, int]:
    """``(elements per token the mixer keeps for backward, its output projection's width)``: its modules' (a meta
    forward), and the query and keys an attention kernel reads, or what a recurrent mixer declares it keeps."""
    positions = torch.arange(_TOKENS, device="meta")[None]
    cos, sin = model.model.rotary_emb(positions, torch.float32)
    elems, out_width = _block_activations(mixer, torch.empty(1, _TOKENS, d, device="meta"), cos, sin, None)
    heads, kv_heads, qk, _ = dims
    kernel = getattr(mixer, "recurrent_activations_per_token", None)
    return elems + (heads * qk + kv_heads * qk if kernel is None else int(kernel)), out_width


def _block_activations(block: nn.Module, *inputs) -> tuple[int, int]:
    """``(Σ leaf outputs but the last + the last's input, the last's output)``, elements per token of one meta
    forward of ``block`` (leaf modules in call order)."""
    calls: list[tuple[int, int]] = []

    def record(module, args, output):
        calls.append((args[0].numel() // _TOKENS, output.numel() // _TOKENS))

    leaves = [m for m in block.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(record) for m in leaves]
    try:
        with torch.no_grad():
            block(*(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs))
    finally:
        for h in hooks:
            h.remove()
    assert calls, f"{type(block).__name__} called no module"
    *kept, (last_in, last_out) = calls
    return sum(out for _, out in kept) + last_in, last_out
