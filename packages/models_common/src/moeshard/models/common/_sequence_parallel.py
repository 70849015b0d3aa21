"""Ulysses sequence parallelism on a model: each rank of a sequence group holds a contiguous shard of every row.

Everything per token (embedding, norms, RoPE at the whole row's positions, router, experts, head, loss) runs on the
shard as it is; each attention module's ``attention_call`` becomes the same call on head shards between two
all-to-alls (``moeshard.sequence.UlyssesAttention``), and the decoder builds its mask for the whole row. The
model then takes a rank's shard as ``moeshard.sequence.shard_row`` gives it::

    apply_sequence_parallel(model, sp_group)
    shard = shard_row(b.input_ids, b.labels, sp_rank=r, sp_size=sp, position_ids=b.position_ids,
                      document_ids=b.document_ids)
    out = model(shard.input_ids, shift_labels=shard.targets, position_ids=shard.position_ids,
                document_ids=shard.row_document_ids, num_items_in_batch=targets_of_the_global_batch)

Needs the ``parallel`` extra (moeshard-sequence), imported only here.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moeshard.models.common._causal_lm import DecoderModel
from moeshard.models.common._layers import attend


def apply_sequence_parallel(model: nn.Module, group) -> int:
    """Run ``model``'s attention on head shards of ``group`` (a process group or 1-D ``DeviceMesh``; consecutive
    ranks of a node) and take each row as this rank's shard of it. Returns the sequence group's size.

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
    if len(decoders) != 1 or not attentions:
        raise ValueError(
            f"apply_sequence_parallel needs a moeshard causal LM (one decoder with attention modules), got "
            f"{type(model).__name__}"
        )
    stateful = sorted({type(m).__name__ for m in model.modules() if getattr(m, "mask_kind", None) == "segments"})
    if stateful:
        raise ValueError(
            f"sequence parallelism (sp={sp}) does not split {', '.join(stateful)} (a recurrent state along the row) "
            "across ranks yet: set parallel.sp to 1 for this model"
        )
    for m in attentions:
        check_sequence_parallel(sp, num_heads=m.num_heads, num_kv_heads=getattr(m, "num_kv_heads", m.num_heads))
    for m in attentions:
        m.attention_call = UlyssesAttention(attend, pg)
    decoders[0].sequence_parallel_size = sp
    decoders[0].sequence_parallel_rank = dist.get_rank(pg)
    return sp
