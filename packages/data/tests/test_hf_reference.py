"""The packed rows predict exactly what each document predicts on its own, checked with transformers' tiny
Qwen3MoeForCausalLM in float32: the (position, target) pairs of the packed rows are the union of every document
piece's own pairs, and with the rows' document mask and positions the per-token losses are the pieces' own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moeshard.data import DataConfig, StepBatches, open_dataset, prepare
from moeshard.data._packing import document_causal_mask

transformers = pytest.importorskip("transformers")
V, E, S = 64, 1, 16


def _model():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float().eval()


def test_packed_rows_match_documents_run_alone(tmp_path, write):
    rng = np.random.default_rng(0)
    lengths = [3, 20, 1, 9, 40, 6, 14, 2, 11]  # several per row, across rows, longer than two rows
    docs = [rng.integers(2, V, n).tolist() for n in lengths]
    write.jsonl(tmp_path / "d.jsonl", [{"input_ids": d} for d in docs])
    prepare(str(tmp_path / "d.jsonl"), tmp_path / "p", eos_id=E, workers=1)
    data = open_dataset(DataConfig(path=str(tmp_path / "p"), seq_len=S), vocab_size=V)
    n_rows = data.sources[0].num_rows
    batch = StepBatches(data, global_batch=n_rows, world_size=1, micro_batch=n_rows).global_batch(0)

    # the stream, who owns each position, and the pieces (runs of one document inside one row)
    stream = [t for d in docs for t in d + [E]]
    owner = [i for i, d in enumerate(docs) for _ in range(len(d) + 1)]
    used = n_rows * S
    pieces, start = [], 0
    for p in range(1, used + 1):
        if p == used or p % S == 0 or owner[p] != owner[p - 1]:
            pieces.append((start, p))
            start = p

    # pairs: (global position t, target predicted from t)
    lab = batch.labels.reshape(-1)
    packed_pairs = {(t, int(lab[t + 1])) for t in range(used - 1) if lab[t + 1] != -100}
    piece_pairs = {(t, stream[t + 1]) for a, b in pieces for t in range(a, b - 1)}
    assert packed_pairs == piece_pairs
    # relative to whole documents: only the pairs that cross a row boundary (or fall in the unused tail) are gone
    doc_pairs = {(t, stream[t + 1]) for t in range(len(stream) - 1) if owner[t] == owner[t + 1]}
    lost = doc_pairs - packed_pairs
    assert packed_pairs <= doc_pairs and all((t + 1) % S == 0 or t + 1 >= used for t, _ in lost)

    model = _model()
    with torch.no_grad():
        logits = model(
            batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=document_causal_mask(batch.document_ids),
        ).logits.reshape(-1, V)
        ref = {}
        for a, b in pieces:
            if b - a < 2:
                continue
            lg = model(torch.tensor([stream[a:b]])).logits[0]
            losses = F.cross_entropy(lg[:-1], torch.tensor(stream[a + 1 : b]), reduction="none")
            ref.update({a + i: float(x) for i, x in enumerate(losses)})
    got = {t: float(F.cross_entropy(logits[t : t + 1], lab[t + 1 : t + 2])) for t, _ in packed_pairs}
    assert got.keys() == ref.keys()
    assert max(abs(got[t] - ref[t]) for t in got) < 1e-5
    # and the loss the training step computes (mean over label tokens, shifted inside) equals the pieces' mean
    shift = F.pad(batch.labels, (0, 1), value=-100)[:, 1:].reshape(-1)
    assert abs(float(F.cross_entropy(logits, shift)) - float(np.mean(list(ref.values())))) < 1e-5
