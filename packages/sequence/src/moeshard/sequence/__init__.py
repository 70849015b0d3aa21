"""moeshard.sequence: Ulysses sequence parallelism. ``sp`` ranks share each row, each holding ``S/sp`` contiguous
tokens; attention runs on head shards between two all-to-alls, everything per token on the local shard.

Example (one rank of a sequence group ``group``; ``attend``: the models' shared attention call)::

    from moeshard.sequence import shard_row, ulysses_attention

    shard = shard_row(batch.input_ids, batch.labels, sp_rank=r, sp_size=sp,
                      position_ids=batch.position_ids, document_ids=batch.document_ids)
    # ... q, k, v of shard.input_ids at shard.position_ids: [B, H, S/sp, D] ...
    out = ulysses_attention(attend, q, k, v, mask_of_the_whole_row, scale=scale, enable_gqa=True, group=group)
    # ... loss on shard.targets (already shifted) ...
"""

from moeshard.sequence._all_to_all import SequenceGroup, heads_to_sequence, sequence_to_heads
from moeshard.sequence._attention import UlyssesAttention, kv_replication, ulysses_attention
from moeshard.sequence._shard import SequenceShard, check_sequence_parallel, shard_row

__all__ = [
    "SequenceGroup",
    "SequenceShard",
    "UlyssesAttention",
    "check_sequence_parallel",
    "heads_to_sequence",
    "kv_replication",
    "sequence_to_heads",
    "shard_row",
    "ulysses_attention",
]
