"""Document-masked packing and padded rows: labels, positions, document ids and segments, exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeshard.data import DataConfig, StepBatches, open_dataset
from moeshard.data._format import TokenStore
from moeshard.data._packing import collate, document_causal_mask, pack_window

E = 99  # EOS in these tests


def expected_rows(docs: list[list[int]], S: int, eos: int = E):
    """Naive reference: the stream of documents + EOS cut into rows; each run of one document in a row is a piece."""
    stream, owner = [], []
    for d, doc in enumerate(docs):
        stream += doc + [eos]
        owner += [d] * (len(doc) + 1)
    rows = []
    for r in range(len(stream) // S):
        ids, own = stream[r * S : (r + 1) * S], owner[r * S : (r + 1) * S]
        labels, pos, dids = [], [], []
        piece, p = -1, 0
        for t in range(S):
            new = t == 0 or own[t] != own[t - 1]
            piece, p = (piece + 1, 0) if new else (piece, p + 1)
            labels.append(-100 if new else ids[t])
            pos.append(p)
            dids.append(piece)
        rows.append((ids, labels, pos, dids))
    return rows


def _dataset(tmp_path, write, docs, S, **kw):
    write.jsonl(tmp_path / "d.jsonl", [{"input_ids": d} for d in docs])
    return open_dataset(DataConfig(path=str(tmp_path / "d.jsonl"), seq_len=S, **kw), vocab_size=100, eos_id=E)


def test_pack_window_by_hand():
    tokens = np.array([10, 11, 12, E, 20, 21, E, 30, 31])
    row = pack_window(tokens, None, np.array([0, 4, 7]))
    assert row.labels.tolist() == [-100, 11, 12, E, -100, 21, E, -100, 31]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    assert row.document_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("seed", range(5))
def test_rows_equal_the_naive_reference(tmp_path, write, seed):
    rng = np.random.default_rng(seed)
    S = 8
    # short documents, documents crossing rows and documents longer than two rows
    docs = [rng.integers(0, 90, rng.integers(1, 3 * S)).tolist() for _ in range(12)]
    data = _dataset(tmp_path, write, docs, S)
    want = expected_rows(docs, S)
    assert data.sources[0].num_rows == len(want)
    for r, (ids, labels, pos, dids) in enumerate(want):
        row = data.sources[0].row(r)
        assert row.input_ids.tolist() == ids
        assert row.labels.tolist() == labels, r
        assert row.position_ids.tolist() == pos
        assert row.document_ids.tolist() == dids
        assert row.attention_mask is None


def test_eos_is_a_target_and_predicts_nothing(tmp_path, write):
    data = _dataset(tmp_path, write, [[1, 2], [3, 4, 5]], 7)
    row = data.sources[0].row(0)
    # [1 2 E | 3 4 5 E]: E of doc 0 is predicted from 2; 3 (next document's first token) is not a target
    assert row.input_ids.tolist() == [1, 2, E, 3, 4, 5, E]
    assert row.labels.tolist() == [-100, 2, E, -100, 4, 5, E]


def test_long_document_is_split_into_pieces_with_positions_from_zero(tmp_path, write):
    doc = list(range(1, 21))  # 20 tokens + EOS = 21 = 3 rows of 7
    data = _dataset(tmp_path, write, [doc], 7)
    rows = [data.sources[0].row(i) for i in range(3)]
    assert [r.input_ids.tolist() for r in rows] == [doc[0:7], doc[7:14], doc[14:20] + [E]]
    for r in rows:
        assert r.position_ids.tolist() == list(range(7))
        assert r.labels[0] == -100 and (r.labels[1:] == r.input_ids[1:]).all()


def test_shard_boundaries_are_document_boundaries():
    store = TokenStore(
        [
            TokenStore.from_documents([(np.array([1, 2, E]), None)], name="a", eos_id=E, has_mask=False).shards[0],
            TokenStore.from_documents([(np.array([3, 4, E]), None)], name="b", eos_id=E, has_mask=False).shards[0],
        ],
        name="ab",
        eos_id=E,
        max_token_id=E,
        fingerprint="",
    )
    tokens, mask, starts = store.window(1, 6)
    assert tokens.tolist() == [2, E, 3, 4, E] and mask is None and starts.tolist() == [0, 2]


def test_masks_survive_packing(tmp_path, write):
    recs = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [5, 6], "loss_mask": [0, 1]}]
    write.jsonl(tmp_path / "m.jsonl", recs)
    data = open_dataset(DataConfig(path=str(tmp_path / "m.jsonl"), seq_len=8), vocab_size=100, eos_id=E)
    row = data.sources[0].row(0)
    assert row.input_ids.tolist() == [1, 2, 3, 4, E, 5, 6, E]
    # the appended EOS is a target when the document's last token is one
    assert row.labels.tolist() == [-100, -100, 3, 4, E, -100, 6, E]


def test_padded_rows(tmp_path, write):
    data = _dataset(tmp_path, write, [[1, 2, 3], list(range(10, 20))], 4, packing=False)
    src = data.sources[0]
    assert src.num_rows == 4  # [1 2 3 E], then 11 tokens in pieces of 4, 4, 3
    last = src.row(3)
    assert last.input_ids.tolist() == [18, 19, E, E]  # padded with EOS (no pad_id given)
    assert last.labels.tolist() == [-100, 19, E, -100]
    assert last.attention_mask.tolist() == [1, 1, 1, 0]
    assert last.document_ids.tolist() == [0, 0, 0, -1]
    b = collate([src.row(0), last], [0, 3], [0, 0])
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b.cu_seqlens.tolist() == [0, 4, 7, 8] and b.max_seqlen == 4


def test_padded_rows_always_have_a_target(tmp_path, write):
    # a record of exactly seq_len tokens plus its EOS, a record of 2·seq_len, an empty one (its lone EOS), a short one
    docs = [[1, 2, 3, 4], list(range(10, 18)), [], [5, 6]]
    data = _dataset(tmp_path, write, docs, 4, packing=False)
    src = data.sources[0]
    rows = [src.row(i) for i in range(src.num_rows)]
    assert [r.input_ids.tolist() for r in rows] == [
        [1, 2, 3, 4],  # the EOS after it would be a row of one token: no row, that EOS is not trained
        [10, 11, 12, 13],
        [14, 15, 16, 17],
        [5, 6, E, E],
    ]
    assert all((r.labels != -100).any() for r in rows)
    assert src.tokens_in_rows(np.arange(src.num_rows)) == 4 + 4 + 4 + 3


def test_collate_segments_and_dense_mask():
    r0 = pack_window(np.array([10, 11, 12, E, 20, 21, E, 30, 31]), None, np.array([0, 4, 7]))
    r1 = pack_window(np.arange(9), None, np.array([0]))
    b = collate([r0, r1], [5, 6], [0, 1])
    assert b.cu_seqlens.tolist() == [0, 4, 7, 9, 18] and b.max_seqlen == 9
    assert b.attention_mask is None and b.sample_ids == (5, 6) and b.num_targets == 6 + 8
    m = document_causal_mask(b.document_ids)
    assert m.shape == (2, 1, 9, 9)
    assert m[0, 0, 5].tolist() == [False] * 4 + [True, True] + [False] * 3
    assert torch.equal(m[1, 0], torch.ones(9, 9, dtype=torch.bool).tril())


def test_synthetic_rows_are_unchanged():
    # The same samples, order and labels (from token 1 on) as the app's former synthetic path.
    cfg = DataConfig(synthetic=True, seq_len=16, synthetic_samples=64, seed=3)
    sb = StepBatches(open_dataset(cfg, vocab_size=300), global_batch=8, world_size=2, micro_batch=2)
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, 97, (64,), generator=g)
    strides = torch.randint(1, 4, (64,), generator=g)
    seqs = (starts[:, None] + strides[:, None] * torch.arange(16)[None, :]) % 97
    for step in (0, 7, 8):  # step 8 wraps into the second epoch
        mbs = sb.micro_batches(step, rank=1)
        for m, b in enumerate(mbs):
            ids = [(step * 8 + 4 + m * 2 + i) % 64 for i in range(2)]
            assert torch.equal(b.input_ids, seqs[ids])
            assert torch.equal(b.labels[:, 1:], seqs[ids][:, 1:])
            assert torch.equal(b.position_ids, torch.arange(16).expand(2, 16))
            assert b.attention_mask is None and (b.document_ids == 0).all()
