"""Held-out loss: the mean over every predicted token of every rank's batches, without gradients.

    from moeshard.data import EvalBatches
    result = evaluate(model, eval_batches.rank_batches(rank))    # on every rank alike
    print(result.loss, result.ppl, result.tokens)

Each rank sums its token losses and counts its targets (labels other than -100 after the shift); one all-reduce adds
both over the ranks, so ranks may hold different token counts (padding, SFT masks, a partial last batch). Every
rank must run the same number of forwards: under expert parallelism each forward exchanges tokens between the
ranks of an EP group (and FSDP gathers parameters), both collective. ``moeshard.data.EvalBatches`` fills the last
global batch with rows that predict nothing for that.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeshard.models.common._lm_loss import IGNORE_INDEX

__all__ = ["EvalResult", "evaluate"]


@dataclass(frozen=True)
class EvalResult:
    """``loss``: mean cross-entropy (nats) over ``tokens`` predicted tokens of all ranks (nan when there are none)."""

    loss: float
    tokens: int

    @property
    def ppl(self) -> float:
        """Perplexity, ``exp(loss)`` (inf past float range, nan without tokens)."""
        if math.isnan(self.loss):
            return math.nan
        return math.exp(self.loss) if self.loss < 709 else math.inf


@torch.no_grad()
def evaluate(
    model: nn.Module,
    micro_batches: Iterable[Any],
    *,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    sp_rank: int = 0,
    sp_size: int = 1,
) -> EvalResult:
    """The model's loss over ``micro_batches`` of every rank of ``group`` (in eval mode, restored afterwards).

    Args:
        model: any family's causal LM (plain or parallelised); called with ``labels`` and
            ``num_items_in_batch=1`` (its loss is then the sum of token losses), the loss through the head in chunks.
        micro_batches: objects with ``input_ids``, ``labels``, ``position_ids``, ``document_ids``,
            ``attention_mask`` and ``to(device, non_blocking)`` (``moeshard.data.Batch``); the same number on every
            rank.
        device: where the forwards run (default: the model's parameters').
        group: the ranks whose batches make the loss (default: the world; none without a process group).
        sp_rank, sp_size: under sequence parallelism (:func:`apply_sequence_parallel`), this rank's place in its
            sequence group: it runs its shard of each row (:func:`model_inputs`), each target counted once.

    Returns:
        One host read at the end: the same result on every rank.
    """
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token losses, predicted tokens
        for b in micro_batches:
            if sp_size > 1:
                from moeshard.models.common._sequence_parallel import model_inputs

                shard = model_inputs(b, sp_rank=sp_rank, sp_size=sp_size).to(device, non_blocking=True)
                out = model(**shard.kwargs, num_items_in_batch=1, output_router_logits=False, return_logits=False)
                totals[0] += out.loss.double()
                totals[1] += shard.num_targets
                continue
            b = b.to(device, non_blocking=True)
            out = model(
                b.input_ids,
                labels=b.labels,
                attention_mask=b.attention_mask,
                position_ids=b.position_ids,
                document_ids=b.document_ids,
                num_items_in_batch=1,  # the loss is the sum over this batch's targets
                output_router_logits=False,
                return_logits=False,
            )
            totals[0] += out.loss.double()
            totals[1] += (b.labels[..., 1:] != IGNORE_INDEX).sum()  # the targets after the model's shift
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        loss_sum, tokens = totals.tolist()
    finally:
        model.train(was_training)
    return EvalResult(loss_sum / tokens if tokens else math.nan, int(tokens))
