"""Activation checkpointing of every decoder layer, with the EP layers' replays and the attention's keep
(:func:`apply_activation_checkpointing`; :func:`moeshard.models.common.parallelize` applies it for
``activation_checkpointing="full"``)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from moeshard.ep import ExpertDispatch, recompute_contexts
from moeshard.models.common._causal_lm import MoECausalLM
from moeshard.models.common._kept import AttentionKeep
from moeshard.models.common._moe import TopKRouter

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: MoECausalLM, *, keep_attention: bool = True) -> None:
    """Recompute each decoder layer in backward: its ``forward`` runs under a non-reentrant
    ``torch.utils.checkpoint`` (the layer's ``execution.checkpoint``; FQNs, the state dict and FSDP's hooks are
    untouched).

    Applied from outside the model (:func:`parallelize` calls it with ``activation_checkpointing="full"``, after EP
    and before compile and FSDP): FSDP's hooks run outside the checkpointed region, as with torch's checkpoint
    wrapper, and the recompute in backward replays the EP layers' received counts and exchange sizes recorded by
    the forward (``moeshard.ep.recompute_contexts`` of the layer's dispatchers): no extra host sync or counts
    exchange. It recomputes what backward keeps and leaves out what only the layer's output needs
    (``discard_outputs``: the experts' down projections, the outputs' way back to their tokens' ranks and the
    combine). Without grad (eval) the forward runs plainly.

    ``keep_attention``: each layer keeps its attention's output and log-sum-exp, its output projection's output and
    its router's top-k from the forward, and the recompute replays them instead of running the attention kernel,
    the projection's GEMM and the selection (``_kept.AttentionKeep``; plain causal rows, see
    ``ParallelOptions.keep_attention``; the top-k of :class:`TopKRouter`). The EP layers replay their route (the
    copies' order) too, always. The same bits.

    Raises:
        ValueError: already applied.
    """
    for layer in model.model.layers:
        if layer.execution.checkpoint is not None:
            raise ValueError("activation checkpointing is already applied to this model; apply it once")
    for layer in model.model.layers:
        layer.execution = dataclasses.replace(layer.execution, checkpoint=_checkpoint(layer, keep_attention))
        for module in layer.modules():
            if isinstance(module, TopKRouter):
                module.selection = module.selection.replace(kept=keep_attention)
    model.model.attention = dataclasses.replace(model.model.attention, keep=keep_attention)


def _checkpoint(layer: torch.nn.Module, keep_attention: bool):
    """``run(forward, *args, **kwargs)``: ``layer``'s ``forward`` checkpointed, with its dispatchers' replays and,
    with ``keep_attention``, the attention's keep."""

    def contexts():
        # Looked up at each call: the dispatchers apply_ep installed, whenever it ran. The routed experts' output
        # only flows into additions in a decoder layer (shared experts, the residual), which save nothing for
        # backward: the recompute leaves out their down projections, the way back and the combine.
        dispatchers = [m.dispatch for m in layer.modules() if isinstance(getattr(m, "dispatch", None), ExpertDispatch)]
        record, replay = recompute_contexts(dispatchers, discard_outputs=True)
        if not keep_attention:
            return record, replay
        keep = AttentionKeep()  # per call: what it keeps lives as long as this checkpoint's graph
        return _Both(record, keep.recording()), _Both(replay, keep.replaying())

    def run(forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


class _Both:
    """Two context managers entered as one (``checkpoint``'s ``context_fn`` returns one per pass)."""

    def __init__(self, first, second) -> None:
        self._contexts, self._stack = (first, second), contextlib.ExitStack()

    def __enter__(self):
        for c in self._contexts:
            self._stack.enter_context(c)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
