"""Evaluation batches: one pass over the rows in order, split over ranks like training, the same number of
micro-batches of the same shape on every rank, filler rows that predict nothing."""

from __future__ import annotations

import pytest
import torch

from moeshard.data import DataConfig, DataError, EvalBatches, StepBatches, open_dataset
from moeshard.data._packing import IGNORE_INDEX


@pytest.fixture
def padded(tmp_path, write):
    docs = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(11)]  # 11 documents of 1..7 tokens
    write.jsonl(tmp_path / "eval.jsonl", docs)
    return open_dataset(
        DataConfig(path=str(tmp_path / "eval.jsonl"), seq_len=8, packing=False), vocab_size=64, eos_id=0
    )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_pass_in_order_with_filler_rows(padded, world):
    assert padded.num_rows == 11
    ev = EvalBatches(padded, global_batch=4, world_size=world, micro_batch=1)
    assert ev.num_batches == 3 and ev.num_rows == 11
    per_rank = [list(ev.rank_batches(r)) for r in range(world)]
    assert {len(mbs) for mbs in per_rank} == {3 * 4 // world}  # every rank runs the same forwards
    assert {tuple(b.input_ids.shape) for mbs in per_rank for b in mbs} == {(1, 8)}
    seen = sorted(i for mbs in per_rank for b in mbs for i in b.sample_ids if i >= 0)
    assert seen == list(range(11))  # every row once
    fillers = [b for mbs in per_rank for b in mbs if b.sample_ids == (-1,)]
    assert len(fillers) == 1 and (fillers[0].labels == IGNORE_INDEX).all()
    # the same rows and targets as the training batches of the same global rows
    train = StepBatches(padded, global_batch=4, world_size=world, micro_batch=1)
    assert torch.equal(ev.micro_batches(1, world - 1)[0].labels, train.micro_batches(1, world - 1)[0].labels)
    targets = sum(b.num_targets for mbs in per_rank for b in mbs)
    last = train.global_batch(2).labels[:3]  # rows 8, 9, 10 (row 11 would start the next epoch)
    assert targets == train.global_batch(0).num_targets + train.global_batch(1).num_targets + int((last != -100).sum())


def test_max_batches_and_errors(padded):
    ev = EvalBatches(padded, global_batch=4, world_size=2, micro_batch=2, max_batches=2)
    assert (ev.num_batches, ev.num_rows) == (2, 8) and len(list(ev.rank_batches(1))) == 2
    assert EvalBatches(padded, global_batch=4, world_size=2, micro_batch=2, max_batches=9).num_batches == 3
    with pytest.raises(DataError, match="max_batches must be"):
        EvalBatches(padded, global_batch=4, world_size=2, micro_batch=2, max_batches=-1)
    with pytest.raises(DataError, match="not divisible by the world size"):
        EvalBatches(padded, global_batch=3, world_size=2, micro_batch=1)
    with pytest.raises(IndexError):
        ev.micro_batches(2, 0)
