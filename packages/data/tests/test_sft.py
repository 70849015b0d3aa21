"""SFT: loss only on assistant tokens (chat templates with and without generation markers), labels/loss_mask
records, and masks kept through prepare and packing."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.data import DataConfig, DataError, open_dataset, prepare
from moeshard.data._inputs import Schema
from moeshard.data._tokenize import EncodeOptions, Encoder, load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}],
    [
        {"role": "system", "content": "you are a tiny model."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "the fox?"},
        {"role": "assistant", "content": "the quick brown fox jumps"},
    ],
]


def encode(tok_dir, conversations, append_eos=False):
    tok = load_tokenizer(str(tok_dir))
    enc = Encoder(EncodeOptions(Schema("messages"), str(tok_dir), tok.eos_token_id, None, append_eos), tokenizer=tok)
    return tok, enc.encode([{"messages": c} for c in conversations], lambda i: f"record {i}")


def targets(tok, doc):
    ids, mask = doc
    return tok.decode(ids[mask.astype(bool)].tolist())


def test_assistant_tokens_only(tok_dir):
    tok, docs = encode(tok_dir, CONVERSATIONS)
    assert targets(tok, docs[0]) == "four.<|im_end|>"
    assert targets(tok, docs[1]) == "hello world<|im_end|>the quick brown fox jumps<|im_end|>"
    ids, mask = docs[1]
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(CONVERSATIONS[1], tokenize=False)


def test_rendering_equals_transformers_generation_markers(tok_dir, make_tok_dir, templates):
    # same rendered text; one template marks assistant tokens for transformers, the other is located by rendering
    _, ours = encode(tok_dir, CONVERSATIONS)
    _, theirs = encode(make_tok_dir(templates["chatml_generation"]), CONVERSATIONS)
    for (a_ids, a_mask), (b_ids, b_mask) in zip(ours, theirs):
        assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()


def test_qwen3_template_drops_earlier_thinking(make_tok_dir, templates):
    tok_dir = make_tok_dir(templates["qwen3"])
    conv = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nhello world"},
        {"role": "user", "content": "the fox?"},
        {"role": "assistant", "content": "the quick brown fox"},
    ]
    tok, docs = encode(tok_dir, [conv])
    assert targets(tok, docs[0]) == "hello world<|im_end|><think>\n\n</think>\n\nthe quick brown fox<|im_end|>"


def test_labels_and_loss_mask_records(tok_dir):
    for field, values in (("labels", [-100, -100, 7, 8]), ("loss_mask", [0, 0, 1, 1])):
        enc = Encoder(EncodeOptions(Schema("tokens", field), None, 99, None))
        ((ids, mask),) = enc.encode([{"input_ids": [5, 6, 7, 8], field: values}], lambda i: "r")
        assert ids.tolist() == [5, 6, 7, 8, 99] and mask.tolist() == [0, 0, 1, 1, 1]


def test_prepared_chat_rows_keep_the_masks(tmp_path, write, tok_dir):
    write.jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS * 3])
    r = prepare(str(tmp_path / "chat.jsonl"), tmp_path / "out", tokenizer=str(tok_dir), workers=1)
    assert r.header["has_loss_mask"] and r.header["kind"] == "messages"
    tok = load_tokenizer(str(tok_dir))
    # The EOS appended after a conversation follows the template's final "\n" (not a target), so it is none either.
    turns = ["four.<|im_end|>", "hello world<|im_end|>the quick brown fox jumps<|im_end|>"]
    padded = open_dataset(DataConfig(path=str(tmp_path / "out"), seq_len=128, packing=False), vocab_size=len(tok))
    assert padded.sources[0].num_rows == 6  # one conversation per row
    for i in range(6):
        row = padded.sources[0].row(i)
        assert tok.decode(row.labels[row.labels != -100].tolist()) == turns[i % 2]
    packed = open_dataset(DataConfig(path=str(tmp_path / "out"), seq_len=32), vocab_size=len(tok))
    text = ""
    for i in range(packed.sources[0].num_rows):
        row = packed.sources[0].row(i)
        text += tok.decode(row.labels[row.labels != -100].tolist())
    # a token that starts a row is no target, so a few are missing: the rest are the assistant turns, in order
    assert _is_subsequence(text, "".join(turns * 3)) and len(text) > 0.6 * len("".join(turns * 3))
    assert "system" not in text and "user" not in text and "helpful" not in text


def _is_subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(c in it for c in small)


def test_conversation_without_assistant_is_refused(tok_dir):
    with pytest.raises(DataError, match="record 0: the conversation has no assistant message"):
        encode(tok_dir, [[{"role": "user", "content": "hi"}]])
    with pytest.raises(DataError, match="record 0: every message needs a string 'role' and 'content'"):
        encode(tok_dir, [[{"role": "user"}, {"role": "assistant", "content": "x"}]])
    assert np.all(
        encode(tok_dir, CONVERSATIONS[:1], append_eos=True)[1][0][0][-1] == load_tokenizer(str(tok_dir)).eos_token_id
    )
