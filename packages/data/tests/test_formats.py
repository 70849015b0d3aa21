"""Inputs (JSONL, gzip, Parquet, datasets folders, globs, lists, folders) and the prepare -> read round trip."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from moeshard.data import DataConfig, DataError, open_dataset, prepare
from moeshard.data._cli import main
from moeshard.data._format import shard_file
from moeshard.data._inputs import InputFile, Schema, plan_units
from moeshard.data._tokenize import EncodeOptions, load_tokenizer

WORDS = "the quick brown fox jumps over the lazy dog, hello world: experts route tokens".split()
TEXTS = [" ".join(WORDS[i % 7 : i % 7 + 3 + i % 5]) + f" number {i}" for i in range(40)]


def direct(tok_dir, texts):
    """The token stream of texts tokenised one by one, each followed by EOS."""
    tok = load_tokenizer(str(tok_dir))
    out = []
    for t in texts:
        out += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def stream_of(data):
    store = data.sources[0].store
    return store.window(0, store.num_tokens)[0].tolist()


def open_raw(path, tok_dir, **kw):
    return open_dataset(DataConfig(path=path, tokenizer=str(tok_dir), seq_len=8, **kw), vocab_size=1000)


def _corpus(tmp_path, write):
    """The same 40 texts as jsonl, jsonl.gz, parquet (3 row groups) and a datasets folder, 10 per file."""
    parts = [TEXTS[i : i + 10] for i in range(0, 40, 10)]
    d = tmp_path / "corpus"
    d.mkdir()
    write.jsonl(d / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(parts[0])])
    write.jsonl(d / "b.jsonl.gz", [{"text": t} for t in parts[1]], gz=True)
    write.parquet(d / "c.parquet", [{"text": t} for t in parts[2]], row_group_size=4)
    import pyarrow as pa

    ds = tmp_path / "ds"
    ds.mkdir()
    with pa.ipc.new_stream(str(ds / "data-00000-of-00001.arrow"), pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": parts[3]}), max_chunksize=3)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return d, ds


def test_every_format_reads_the_same_tokens(tmp_path, write, tok_dir):
    d, ds = _corpus(tmp_path, write)
    want = direct(tok_dir, TEXTS)
    per_file = [str(d / "a.jsonl"), str(d / "b.jsonl.gz"), str(d / "c.parquet"), str(ds)]
    assert stream_of(open_raw(per_file, tok_dir)) == want  # a list, in order
    assert stream_of(open_raw([str(d), str(ds)], tok_dir)) == want  # a folder (sorted) + a datasets folder
    assert stream_of(open_raw([str(d / "*"), str(ds)], tok_dir)) == want  # a glob
    assert stream_of(open_raw(str(d / "b.jsonl.gz"), tok_dir)) == direct(tok_dir, TEXTS[10:20])


def test_datasets_save_to_disk_folder(tmp_path, tok_dir):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "hf"))
    assert stream_of(open_raw(str(tmp_path / "hf"), tok_dir)) == direct(tok_dir, TEXTS)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train'\]; point at one split, e.g. .*dd/train"):
        open_raw(str(tmp_path / "dd"), tok_dir)
    assert stream_of(open_raw(str(tmp_path / "dd" / "train"), tok_dir)) == direct(tok_dir, TEXTS)


def test_prepare_round_trip_equals_direct_tokenisation(tmp_path, write, tok_dir):
    d, ds = _corpus(tmp_path, write)
    out = tmp_path / "prepared"
    r = prepare([str(d), str(ds)], out, tokenizer=str(tok_dir), workers=1, chunk_mb=1)
    want = direct(tok_dir, TEXTS)
    assert (r.num_tokens, r.num_documents, r.shards_written, r.shards_reused) == (len(want), 40, 4, 0)
    header = json.loads((out / "header.json").read_text())
    assert header["dtype"] == "uint32" and header["eos_id"] == load_tokenizer(str(tok_dir)).eos_token_id
    assert header["tokenizer"]["vocab_size"] == len(load_tokenizer(str(tok_dir))) and len(header["fingerprint"]) == 32
    assert np.fromfile(shard_file(out, 0, "tokens"), dtype=np.uint32).tolist() == direct(tok_dir, TEXTS[:10])
    data = open_dataset(DataConfig(path=str(out), seq_len=8), vocab_size=1000)
    assert stream_of(data) == want
    raw = open_raw([str(d), str(ds)], tok_dir)
    for i in range(data.sources[0].num_rows):  # same rows as the raw path
        a, b = data.sources[0].row(i), raw.sources[0].row(i)
        assert (a.input_ids == b.input_ids).all() and (a.labels == b.labels).all()
    # again: everything reused, same fingerprint
    r2 = prepare([str(d), str(ds)], out, tokenizer=str(tok_dir), workers=1, chunk_mb=1)
    assert (r2.shards_written, r2.shards_reused) == (0, 4) and r2.header["fingerprint"] == header["fingerprint"]


def test_prepare_in_parallel_matches_one_process(tmp_path, write, tok_dir):
    big = tmp_path / "big.jsonl"
    write.jsonl(big, [{"text": t} for t in TEXTS * 100])  # ~160 KB in 7 units
    one = prepare(str(big), tmp_path / "one", tokenizer=str(tok_dir), workers=1, chunk_mb=0.03)
    # fork: spawned workers would re-import torch (seconds each); what spawn needs is that the work pickles
    two = prepare(str(big), tmp_path / "two", tokenizer=str(tok_dir), workers=2, chunk_mb=0.03, start_method="fork")
    pickle.dumps(
        (EncodeOptions(Schema("text"), str(tok_dir), 0, None), plan_units([InputFile(str(big), "jsonl", 9)], 4))
    )
    assert len(one.header["shards"]) == 7 and two.shards_written == 7
    assert one.header["shards"] == two.header["shards"] and one.header["fingerprint"] == two.header["fingerprint"]
    assert one.num_tokens == len(direct(tok_dir, TEXTS)) * 100


def test_prepare_resumes_after_a_crash(tmp_path, write, tok_dir):
    d = tmp_path / "in"
    d.mkdir()
    for i in range(4):
        write.jsonl(d / f"{i}.jsonl", [{"text": t} for t in TEXTS[i * 10 : (i + 1) * 10]])
    write.jsonl(d / "2.jsonl", [{"text": t} for t in TEXTS[20:25]] + [{"txt": "bad"}])  # a bad record at line 6
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"2\.jsonl:6: record has no 'text'"):
        prepare(str(d), out, tokenizer=str(tok_dir), workers=1)
    assert not (out / "header.json").exists() and (shard_file(out, 1, "json")).exists()
    write.jsonl(d / "2.jsonl", [{"text": t} for t in TEXTS[20:30]])  # fixed
    # a shard torn mid-write: its .json is missing and a temporary file lies around
    shard_file(out, 1, "json").unlink()
    shard_file(out, 1, "tokens").write_bytes(b"\0\0")
    (out / "shard-00001.tokens.tmp").write_bytes(b"junk")
    r = prepare(str(d), out, tokenizer=str(tok_dir), workers=1)
    assert (r.shards_written, r.shards_reused) == (3, 1)
    # a finished corpus whose token file was truncated afterwards: refused at open, redone by a re-run
    with open(shard_file(out, 3, "tokens"), "r+b") as f:
        f.truncate(8)
    with pytest.raises(DataError, match=r"shard-00003.tokens: 8 bytes, expected \d+ bytes; run prepare on the same"):
        open_dataset(DataConfig(path=str(out), seq_len=8), vocab_size=1000)
    r = prepare(str(d), out, tokenizer=str(tok_dir), workers=1)
    assert (r.shards_written, r.shards_reused) == (1, 3)  # 1 (torn), 2 (fixed input), 3 (never reached); 0 kept
    assert stream_of(open_dataset(DataConfig(path=str(out), seq_len=8), vocab_size=1000)) == direct(tok_dir, TEXTS)


def test_cli_prepare_and_inspect(tmp_path, write, tok_dir, capsys):
    write.jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "out"
    argv = ["prepare", "--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tok_dir), "--output", str(out)]
    assert main([*argv, "--workers", "1"]) == 0
    assert "40 documents, 1 shard(s) written" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["num_documents"] == 40
    assert main(["prepare", "--input", str(tmp_path / "none.jsonl"), "--output", str(out)]) == 2
    assert capsys.readouterr().err.startswith("moeshard.data: error: ") and os.listdir(out)
    res = subprocess.run([sys.executable, "-m", "moeshard.data", "inspect", str(out)], capture_output=True, text=True)
    assert res.returncode == 0 and json.loads(res.stdout)["num_tokens"] > 0, res.stderr


def test_prepare_tokens_without_tokenizer(tmp_path, write):
    write.jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4]}])
    r = prepare(str(tmp_path / "t.jsonl"), tmp_path / "o", eos_id=0, workers=1)
    assert (r.num_tokens, r.num_documents, r.header["has_loss_mask"]) == (6, 2, False)  # the empty record is dropped
    data = open_dataset(DataConfig(path=str(tmp_path / "o"), seq_len=3), vocab_size=5)
    assert stream_of(data) == [1, 2, 3, 0, 4, 0]
