"""Mixtures and step determinism: the global batch of a step is a pure function of (config, step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeshard.data import DataConfig, PrefetchLoader, StepBatches, open_dataset, prepare
from moeshard.data._dataset import permute

E = 0


def _source(tmp_path, write, name, n_docs, lo, hi, seed):
    rng = np.random.default_rng(seed)
    docs = [{"input_ids": rng.integers(lo, hi, rng.integers(1, 40)).tolist()} for _ in range(n_docs)]
    write.jsonl(tmp_path / f"{name}.jsonl", docs)
    return str(prepare(str(tmp_path / f"{name}.jsonl"), tmp_path / name, eos_id=E, workers=1).output)


@pytest.fixture
def mixture_cfg(tmp_path, write):
    # token ranges identify the source of every row
    paths = [
        _source(tmp_path, write, n, d, lo, hi, s)
        for n, d, lo, hi, s in (("a", 50, 1, 100, 0), ("b", 200, 100, 200, 1), ("c", 10, 200, 300, 2))
    ]
    return DataConfig(
        sources=[
            {"path": paths[0], "weight": 0.5},
            {"path": paths[1], "weight": 0.3},
            {"path": paths[2], "weight": 0.2},
        ],
        seq_len=16,
        shuffle=True,
        seed=7,
    )


def test_global_batch_is_the_same_for_every_world_size(mixture_cfg):
    data = open_dataset(mixture_cfg, vocab_size=300)
    for step in (0, 3, 41):
        ref = StepBatches(data, global_batch=16, world_size=1, micro_batch=4).global_batch(step)
        for W in (1, 2, 4):
            sb = StepBatches(data, global_batch=16, world_size=W, micro_batch=2)
            mbs = [b for r in range(W) for b in sb.micro_batches(step, r)]
            for key in ("input_ids", "labels", "position_ids", "document_ids"):
                assert torch.equal(torch.cat([getattr(b, key) for b in mbs]), getattr(ref, key)), (step, W, key)
            assert sum((b.source_ids for b in mbs), ()) == ref.source_ids


def test_resume_needs_no_state(mixture_cfg):
    # a fresh process (here: fresh objects) at step 5 gives what an uninterrupted run gives at step 5
    a = StepBatches(open_dataset(mixture_cfg, vocab_size=300), global_batch=8, world_size=2, micro_batch=2)
    run = [a.micro_batches(s, 1) for s in range(6)]
    b = StepBatches(open_dataset(mixture_cfg, vocab_size=300), global_batch=8, world_size=2, micro_batch=2)
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(run[5], b.micro_batches(5, 1)))


def test_proportions_and_tokens_per_source(mixture_cfg):
    data = open_dataset(mixture_cfg, vocab_size=300)
    sb = StepBatches(data, global_batch=10, world_size=2, micro_batch=5)
    counts = np.zeros(3, int)
    for step in range(20):
        b = sb.global_batch(step)
        src = np.array(b.source_ids)
        counts += np.bincount(src, minlength=3)
        # rows really come from the source they are attributed to (token ranges are disjoint)
        for row, k in zip(b.input_ids, src):
            toks = row[row != E]
            assert ((toks >= [1, 100, 200][k]) & (toks < [100, 200, 300][k])).all()
        per_step = np.bincount(src, minlength=3)
        assert np.abs(per_step - np.array([5, 3, 2])).max() <= 1  # even interleaving, not bursts
    assert counts.tolist() == [100, 60, 40]
    assert sb.tokens_per_source(0, 20) == {"a": 100 * 16, "b": 60 * 16, "c": 40 * 16}
    assert sum(sb.tokens_per_source(3, 4).values()) == 10 * 16
    summary = data.summary()  # what a run stores to recognise its data on resume
    assert list(summary) == ["a", "b", "c"] and summary["a"]["documents"] == 50
    assert summary["b"]["tokens"] == data.sources[1].store.num_tokens and summary["c"]["weight"] == pytest.approx(0.2)
    assert "+".join(s["fingerprint"] for s in summary.values()) == data.fingerprint


def test_small_source_repeats_in_new_orders(mixture_cfg):
    data = open_dataset(mixture_cfg, vocab_size=300)
    c = data.sources[2]
    src, idx = data.locate(np.arange(4000))
    rows_c = idx[src == 2]
    n = c.num_rows
    epochs = [rows_c[i * n : (i + 1) * n] for i in range(len(rows_c) // n)]
    assert len(epochs) >= 2 and all(sorted(e.tolist()) == list(range(n)) for e in epochs)  # each epoch: all rows
    assert epochs[0].tolist() != epochs[1].tolist()


def test_permutation_is_a_bijection():
    for n in (1, 2, 3, 7, 1000, 4097):
        p = permute(np.arange(n), n, key=12345)
        assert sorted(p.tolist()) == list(range(n))
    assert permute(np.arange(100), 100, 1).tolist() != permute(np.arange(100), 100, 2).tolist()


def test_unshuffled_single_source_is_in_file_order(tmp_path, write):
    write.jsonl(tmp_path / "t.jsonl", [{"input_ids": list(range(1, 9))} for _ in range(3)])  # 27 tokens
    data = open_dataset(DataConfig(path=str(tmp_path / "t.jsonl"), seq_len=9), vocab_size=10, eos_id=E)
    sb = StepBatches(data, global_batch=2, world_size=1, micro_batch=1)
    ids = [sb.micro_batches(s, 0)[m].input_ids[0, 0].item() for s in range(3) for m in range(2)]
    assert ids == [1, 1, 1, 1, 1, 1] and sb.micro_batches(1, 0)[0].sample_ids == (2,)
    assert [sb.global_batch(s).source_ids for s in range(2)] == [(0, 0), (0, 0)]


def test_prefetch_loader_yields_what_step_batches_give(mixture_cfg):
    sb = StepBatches(open_dataset(mixture_cfg, vocab_size=300), global_batch=8, world_size=2, micro_batch=2)
    with PrefetchLoader(sb, rank=1, start_step=3, stop_step=9, depth=2, pin_memory=False) as loader:
        got = list(loader)
    assert [s for s, _ in got] == list(range(3, 9))
    for step, mbs in got:
        for x, y in zip(mbs, sb.micro_batches(step, 1)):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)


def test_prefetch_loader_raises_producer_errors_and_stops_early(mixture_cfg):
    sb = StepBatches(open_dataset(mixture_cfg, vocab_size=300), global_batch=8, world_size=2, micro_batch=2)

    class Boom(StepBatches):
        def micro_batches(self, step, rank):
            if step == 2:
                raise RuntimeError("boom at 2")
            return super().micro_batches(step, rank)

    boom = Boom(sb.dataset, global_batch=8, world_size=2, micro_batch=2)
    with PrefetchLoader(boom, rank=0, start_step=0, stop_step=5, pin_memory=False) as loader:
        it = iter(loader)
        assert next(it)[0] == 0 and next(it)[0] == 1
        with pytest.raises(RuntimeError, match="boom at 2"):
            next(it)
    loader = PrefetchLoader(sb, rank=0, start_step=0, stop_step=10**9, depth=1, pin_memory=False)
    assert next(iter(loader))[0] == 0
    loader.close()  # returns although the producer is blocked on a full queue
    assert not loader._thread.is_alive()
