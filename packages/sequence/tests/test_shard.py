"""One rank's view of packed rows: its shard, the targets shifted before the split, whole-row positions and
documents; the checks of an sp size."""

import pytest
import torch

from moeshard.sequence import check_sequence_parallel, shard_row
from moeshard.sequence._shard import IGNORE_INDEX, shift_labels

X = IGNORE_INDEX


def _packed_row():
    # One row of 8 tokens: documents [10 11 12] [20 21 22 23] [30]; a piece's first token is no target (as
    # moeshard.data packs), positions restart per document.
    input_ids = torch.tensor([[10, 11, 12, 20, 21, 22, 23, 30]])
    labels = torch.tensor([[X, 11, 12, X, 21, 22, 23, X]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]], dtype=torch.int32)
    return input_ids, labels, position_ids, document_ids


def test_each_rank_holds_its_contiguous_shard_with_targets_shifted_before_the_split():
    input_ids, labels, position_ids, document_ids = _packed_row()
    shards = [
        shard_row(input_ids, labels, sp_rank=r, sp_size=4, position_ids=position_ids, document_ids=document_ids)
        for r in range(4)
    ]
    assert [s.input_ids.tolist() for s in shards] == [[[10, 11]], [[12, 20]], [[21, 22]], [[23, 30]]]
    # token t's target is the row's labels[t + 1]: across every shard edge too (11 -> 12 on rank 0, 20 -> 21 on
    # rank 1, 22 -> 23 on rank 2); the last token of a document predicts nothing (the next piece's first label is -100)
    assert [s.targets.tolist() for s in shards] == [[[11, 12]], [[X, 21]], [[22, 23]], [[X, X]]]
    assert [s.position_ids.tolist() for s in shards] == [[[0, 1]], [[2, 0]], [[1, 2]], [[3, 0]]]
    assert [s.document_ids.tolist() for s in shards] == [[[0, 0]], [[0, 1]], [[1, 1]], [[1, 2]]]
    assert all(s.row_document_ids is document_ids for s in shards)  # the whole row's, for the attention mask
    assert [(s.start, s.stop, s.seq_len) for s in shards] == [(0, 2, 8), (2, 4, 8), (4, 6, 8), (6, 8, 8)]
    # every target counted once: the shards' targets are the whole row's shifted labels
    assert torch.equal(torch.cat([s.targets for s in shards], dim=1), shift_labels(labels))
    assert sum(s.num_targets for s in shards) == int((labels != X).sum()) == 5


def test_an_unshifted_split_would_lose_the_pair_across_the_edge():
    input_ids, labels, *_ = _packed_row()
    naive = [shift_labels(labels[:, r * 2 : r * 2 + 2]) for r in range(4)]  # shifting each shard on its own
    assert sum(int((t != X).sum()) for t in naive) == 2  # the three pairs across an edge were lost
    assert sum(shard_row(input_ids, labels, sp_rank=r, sp_size=4).num_targets for r in range(4)) == 5


def test_defaults_padding_and_several_rows():
    input_ids = torch.arange(12).reshape(2, 6)
    labels = input_ids.clone()
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    shard = shard_row(input_ids, labels, sp_rank=1, sp_size=2, attention_mask=attention_mask)
    assert shard.input_ids.tolist() == [[3, 4, 5], [9, 10, 11]]
    assert shard.targets.tolist() == [[4, 5, X], [10, 11, X]]  # the row's last token predicts nothing
    assert shard.position_ids.tolist() == [[3, 4, 5], [3, 4, 5]]  # default positions: the whole row's 0..S-1
    assert shard.document_ids is None and shard.row_document_ids is None
    assert shard.attention_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert shard.row_attention_mask is attention_mask
    one = shard_row(input_ids, labels, sp_rank=0, sp_size=1, position_ids=torch.arange(6))
    assert torch.equal(one.input_ids, input_ids) and torch.equal(one.targets, shift_labels(labels))
    assert one.position_ids.shape == (2, 6)


def test_bad_input_is_refused_in_one_line():
    input_ids, labels, position_ids, document_ids = _packed_row()
    cases = [
        (dict(sp_rank=0, sp_size=3), "seq_len=8 is not divisible by sp_size=3"),
        (dict(sp_rank=2, sp_size=2), "sp_rank=2 must be in [0, sp_size=2)"),
        (dict(sp_rank=0, sp_size=0), "sp_size=0 must be a positive integer"),
        (dict(sp_rank=0, sp_size=2, document_ids=document_ids[:, :4]), "document_ids must have input_ids' shape"),
        (dict(sp_rank=0, sp_size=2, position_ids=position_ids[:, :4]), "position_ids must be [seq_len]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            shard_row(input_ids, labels, **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="labels must have"):
        shard_row(input_ids, labels[:, :4], sp_rank=0, sp_size=2)


def test_check_sequence_parallel_names_the_fix():
    check_sequence_parallel(4, seq_len=4096, num_heads=32, num_kv_heads=4)  # Qwen3-30B-A3B at sp 4
    check_sequence_parallel(8, seq_len=4096, num_heads=32, num_kv_heads=4)  # sp above the KV heads: replicated
    for kwargs, fix in [
        (dict(seq_len=4095), "set seq_len to a multiple of 4 (e.g. 4096)"),
        (dict(num_heads=6), "choose sp_size among [1, 2, 3, 6]"),
        (dict(num_heads=32, num_kv_heads=5), "fix the model's config"),
    ]:
        with pytest.raises(ValueError) as err:
            check_sequence_parallel(4, **kwargs)
        assert fix in str(err.value) and "\n" not in str(err.value)
