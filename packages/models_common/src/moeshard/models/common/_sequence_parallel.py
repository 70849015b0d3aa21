"""Ulysses sequence parallelism on a model: each rank of a sequence group holds a contiguous shard of every row.

Everything per token (embedding, norms, RoPE at the whole row's positions, router, experts, head, loss) runs on the
shard as it is; each attention module's ``attention_call`` becomes the same call on head shards between two
all-to-alls (``moeshard.sequence.UlyssesAttention``), so does a recurrent mixer's ``row_call`` (its convolution and
state along the whole row, for its heads), and the decoder builds its mask for the whole row. The
model then takes a rank's shard as ``moeshard.sequence.shard_row`` gives it::

    apply_sequence_parallel(model, sp_group)
    shard = shard_row(b.input_ids, b.labels, sp_rank=r, sp_size=sp, position_ids=b.position_ids,
                      document_ids=b.document_ids)
    out = model(shard.input_ids, shift_labels=shard.targets, position_ids=shard.position_ids,
                document_ids=shard.row_document_ids, num_items_in_batch=targets_of_the_global_batch)

Needs the ``parallel`` extra (moeshard-sequence), imported only here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moeshard.models.common._causal_lm import DecoderModel
from moeshard.models.common._layers import attend
from moeshard.models.common._sequence_layout import SequenceLayout


def apply_sequence_parallel(model: nn.Module, group) -> int:
    """Run ``model``'s attention on head shards of ``group`` (a process group or 1-D ``DeviceMesh``; consecutive
    ranks of a node) and take each row as this rank's shard of it (the decoder's ``sequence``, a
    ``SequenceLayout`` of the group's size and this rank). Returns the sequence group's size.

    Every module with an ``attention_call`` (each family's attention, MLA included) gets the call on head shards;
    its query heads must divide by the group's size (key/value heads need not: they are replicated). A group of one
    (or None) changes nothing.
    """
    from moeshard.sequence import UlyssesAttention, check_sequence_parallel

    pg = group.get_group() if isinstance(group, DeviceMesh) else group
    sp = 1 if pg is None else dist.get_world_size(pg)
    if sp == 1:
        return 1
    decoders = [m for m in model.modules() if isinstance(m, DecoderModel)]
    attentions = [m for m in model.modules() if hasattr(m, "attention_call")]
    rows = [m for m in model.modules() if hasattr(m, "row_call")]
    if len(decoders) != 1 or not (attentions or rows):
        raise ValueError(
            f"apply_sequence_parallel needs a moeshard causal LM (one decoder with attention modules), got "
            f"{type(model).__name__}"
        )
    stateful = {m for m in model.modules() if getattr(m, "mask_kind", None) == "segments"}
    unsplit = sorted({type(m).__name__ for m in stateful - set(rows)})
    if unsplit:
        raise ValueError(
            f"sequence parallelism (sp={sp}) does not split {', '.join(unsplit)} (a recurrent state along the row, "
            "without a row_call to run on head shards) across ranks: set parallel.sp_size to 1 for this model"
        )
    for m in attentions:
        check_sequence_parallel(sp, num_heads=m.num_heads, num_kv_heads=getattr(m, "num_kv_heads", m.num_heads))
    for m in rows:  # no replication: each key head's state is its value heads', all on one rank
        if m.num_heads % sp or m.num_kv_heads % sp:
            raise ValueError(
                f"sequence parallelism sp={sp} splits {type(m).__name__}'s heads over ranks: its {m.num_heads} value "
                f"heads and {m.num_kv_heads} key heads must both divide by sp; use an sp that divides both"
            )
    for m in attentions:
        m.attention_call = UlyssesAttention(attend, pg)
    for m in rows:
        m.row_call = _RowOnHeadShards(type(m).row_call, pg)
    decoders[0].sequence = SequenceLayout(size=sp, rank=dist.get_rank(pg))
    return sp


class _RowOnHeadShards:
    """A recurrent mixer's ``row_call`` (``linear_attention_row``'s signature) on head shards: the per-token inputs
    (q, k, v as projected, before the convolution, which runs along the whole row; the per-head gates) trade this
    rank's tokens of every head for the whole row of its ``1/sp`` of the heads, the call runs there with those heads'
    convolution weights, and its output comes back to this rank's tokens of every head."""

    def __init__(self, call, group) -> None:
        self.call, self.group = call, group

    def __call__(self, q_BsGD, k_BsGD, v_BsHD, g_BsH, beta_BsH, conv_weights, segments, kernels) -> torch.Tensor:
        from moeshard.sequence import heads_to_sequence, sequence_to_heads

        sp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        shards = [sequence_to_heads(t, self.group, head_dim=2, seq_dim=1) for t in (q_BsGD, k_BsGD, v_BsHD)]
        gates = [sequence_to_heads(t, self.group, head_dim=2, seq_dim=1) for t in (g_BsH, beta_BsH)]
        weights = tuple(w.chunk(sp)[rank] for w in conv_weights)  # rank r: heads [r·H/sp, (r+1)·H/sp)
        out_BShD = self.call(*shards, *gates, weights, segments, kernels)
        return heads_to_sequence(out_BShD, self.group, head_dim=2, seq_dim=1)


@dataclass(frozen=True)
class ModelInputs:
    """What one rank gives the model for a micro-batch of whole rows (:func:`model_inputs`).

    Attributes:
        kwargs: the model's keyword arguments: ``input_ids``, ``labels`` (or ``shift_labels``: a shard's targets,
            shifted over the whole row), ``position_ids``, ``document_ids``, ``attention_mask`` (the last two the
            whole row's).
        token_mask: the padding mask of this rank's tokens (per-token statistics: balancing), or None.
        rows: rows of the micro-batch.
        num_targets: this rank's targets (the batch's ``num_targets``, or its shard's); summed over the ranks, each
            target of the global batch counts once.
    """

    kwargs: dict[str, torch.Tensor | None]
    token_mask: torch.Tensor | None
    rows: int
    num_targets: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInputs:
        """The tensors on ``device`` (``num_targets`` stays where it is)."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(
            self, kwargs={k: move(v) for k, v in self.kwargs.items()}, token_mask=move(self.token_mask)
        )


def model_inputs(batch, *, sp_rank: int = 0, sp_size: int = 1) -> ModelInputs:
    """Sequence rank ``sp_rank``'s model inputs for ``batch`` (``moeshard.data.Batch``: whole rows).

    With ``sp_size`` 1 the batch as it is (labels shifted by the model); otherwise ``moeshard.sequence.shard_row``'s
    shard: its tokens, targets and positions, the whole row's document ids and padding mask."""
    if sp_size == 1:
        labels = batch.labels
        return ModelInputs(
            kwargs={
                "input_ids": batch.input_ids,
                "labels": labels,
                "position_ids": batch.position_ids,
                "document_ids": batch.document_ids,
                "attention_mask": batch.attention_mask,
            },
            token_mask=batch.attention_mask,
            rows=batch.input_ids.shape[0],
            num_targets=batch.num_targets,
        )
    from moeshard.sequence import shard_row

    shard = shard_row(
        batch.input_ids,
        batch.labels,
        sp_rank=sp_rank,
        sp_size=sp_size,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        attention_mask=batch.attention_mask,
    )
    return ModelInputs(
        kwargs={
            "input_ids": shard.input_ids,
            "shift_labels": shard.targets,
            "position_ids": shard.position_ids,
            "document_ids": shard.row_document_ids,
            "attention_mask": shard.row_attention_mask,
        },
        token_mask=shard.attention_mask,
        rows=shard.input_ids.shape[0],
        num_targets=shard.num_targets,
    )
