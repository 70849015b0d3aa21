"""Bad input: one line naming the file/record/key and the fix, raised before anything is written."""

from __future__ import annotations

import gzip
import os

import pytest

from moeshard.data import DataConfig, DataError, SourceConfig, open_dataset, prepare


def refused(tmp_path, inputs, match, **kw):
    """prepare() raises DataError matching ``match``, in one line, and the output folder was not created."""
    out = tmp_path / "out"
    with pytest.raises(DataError, match=match) as e:
        prepare(inputs, out, workers=1, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists(), "the output folder was touched before validation"
    return str(e.value)


@pytest.fixture
def good(tmp_path, write):
    return str(write.jsonl(tmp_path / "good.jsonl", [{"text": "hello world"}, {"text": "the fox"}]))


def test_missing_and_unreadable_files(tmp_path, good, tok_dir):
    t = str(tok_dir)
    refused(tmp_path, [good, str(tmp_path / "gone.jsonl")], r"gone\.jsonl does not exist; fix the path", tokenizer=t)
    refused(tmp_path, str(tmp_path / "*.parquet"), r"\*\.parquet: the pattern matches no file", tokenizer=t)
    os.symlink(tmp_path / "nowhere.jsonl", tmp_path / "dangling.jsonl")
    refused(tmp_path, str(tmp_path / "*.jsonl"), r"dangling\.jsonl is a broken link", tokenizer=t)
    os.unlink(tmp_path / "dangling.jsonl")
    (tmp_path / "adir").mkdir()
    os.symlink(tmp_path / "adir", tmp_path / "link.jsonl")
    refused(tmp_path, str(tmp_path / "*.jsonl"), r"link\.jsonl: cannot be read \(Is a directory\)", tokenizer=t)
    os.unlink(tmp_path / "link.jsonl")
    (tmp_path / "notes.txt").write_text("x")
    refused(tmp_path, [good, str(tmp_path / "notes.txt")], r"notes\.txt: unknown file type; use \.jsonl", tokenizer=t)
    refused(tmp_path, str(tmp_path / "adir"), r"adir: the folder holds no \.jsonl", tokenizer=t)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_permission_denied(tmp_path, good, tok_dir):
    os.chmod(good, 0)
    refused(
        tmp_path,
        good,
        r"good\.jsonl: cannot be read \(Permission denied\); fix its permissions",
        tokenizer=str(tok_dir),
    )


def test_corrupt_parquet_and_gzip(tmp_path, write, good, tok_dir):
    t = str(tok_dir)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    refused(tmp_path, [good, str(tmp_path / "bad.parquet")], r"bad\.parquet: not a readable Parquet file", tokenizer=t)
    os.unlink(tmp_path / "bad.parquet")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    refused(tmp_path, [good, str(tmp_path / "bad.jsonl.gz")], r"bad\.jsonl\.gz: corrupt or truncated gzip", tokenizer=t)
    # a valid header and a truncated body: found while tokenising, the unit's shard is not written
    payload = gzip.compress(b"".join(b'{"text": "record %d"}\n' % i for i in range(5000)))
    (tmp_path / "bad.jsonl.gz").write_bytes(payload[: len(payload) // 2])
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: corrupt or truncated gzip .*re-create or remove the file"):
        prepare([good, str(tmp_path / "bad.jsonl.gz")], tmp_path / "o2", tokenizer=t, workers=1)
    assert not (tmp_path / "o2" / "header.json").exists() and not (tmp_path / "o2" / "shard-00001.json").exists()


def test_records(tmp_path, write, tok_dir):
    t = str(tok_dir)
    write.jsonl(tmp_path / "a.jsonl", [{"text": "a"}, {"text": "b"}, {"body": "c"}])
    with pytest.raises(DataError, match=r"a\.jsonl:3: record has no 'text' \(keys: \['body'\]\); every record"):
        prepare(str(tmp_path / "a.jsonl"), tmp_path / "o", tokenizer=t, workers=1)
    (tmp_path / "b.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match=r"b\.jsonl:2: not valid JSON"):
        open_dataset(DataConfig(path=str(tmp_path / "b.jsonl"), tokenizer=t), vocab_size=1000)
    write.jsonl(tmp_path / "c.jsonl", [{"body": "c"}])
    refused(
        tmp_path,
        str(tmp_path / "c.jsonl"),
        r"c\.jsonl: records have none of the fields 'text', 'messages', 'input_ids'",
        tokenizer=t,
    )
    write.jsonl(tmp_path / "d.jsonl", [{"text": 5}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: 'text' must be a string"):
        open_dataset(DataConfig(path=str(tmp_path / "d.jsonl"), tokenizer=t), vocab_size=1000)
    write.jsonl(tmp_path / "e.jsonl", [{"input_ids": [1, 2], "labels": [1, 3]}])
    with pytest.raises(DataError, match=r"e\.jsonl:1: labels must equal input_ids or be -100"):
        open_dataset(DataConfig(path=str(tmp_path / "e.jsonl")), vocab_size=1000)


def test_mixed_schemas_and_empty_sources(tmp_path, write, tok_dir):
    t = str(tok_dir)
    write.jsonl(tmp_path / "a.jsonl", [{"text": "a"}])
    write.parquet(tmp_path / "b.parquet", [{"messages": [{"role": "user", "content": "x"}]}])
    refused(
        tmp_path,
        [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")],
        r"mixed schemas: .*a\.jsonl holds 'text' but .*b\.parquet holds 'messages'; put them in separate sources",
        tokenizer=t,
    )
    write.jsonl(tmp_path / "c.jsonl", [{"input_ids": [1], "loss_mask": [1]}])
    write.jsonl(tmp_path / "d.jsonl", [{"input_ids": [1]}])
    refused(
        tmp_path,
        [str(tmp_path / "c.jsonl"), str(tmp_path / "d.jsonl")],
        r"holds 'input_ids' with 'loss_mask' but .*d\.jsonl holds 'input_ids'",
        eos_id=0,
    )
    (tmp_path / "e1.jsonl").write_text("")
    (tmp_path / "e2.jsonl").write_text("\n\n")
    refused(tmp_path, str(tmp_path / "e*.jsonl"), r"empty source \(no record in 2 file\(s\)\); add data", tokenizer=t)
    with pytest.raises(DataError, match=r"source 'e': empty source"):
        open_dataset(
            DataConfig(sources=[{"path": str(tmp_path / "e*.jsonl"), "name": "e"}], tokenizer=t), vocab_size=10
        )


def test_vocabulary(tmp_path, write):
    write.jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 70]}])
    with pytest.raises(
        DataError,
        match=r"t\.jsonl:2: token id 70 is outside the vocabulary \[0, 50\); the data was tokenised for another model",
    ):
        prepare(str(tmp_path / "t.jsonl"), tmp_path / "o", eos_id=0, vocab_size=50, workers=1)
    prepare(str(tmp_path / "t.jsonl"), tmp_path / "ok", eos_id=0, workers=1)
    with pytest.raises(DataError, match=r"source 'ok' holds token id 70, outside the model's vocabulary \[0, 64\)"):
        open_dataset(DataConfig(path=str(tmp_path / "ok")), vocab_size=64)
    with pytest.raises(DataError, match=r"t\.jsonl:2: token id 70 is outside the vocabulary \[0, 64\)"):
        open_dataset(DataConfig(path=str(tmp_path / "t.jsonl")), vocab_size=64, eos_id=0)


def test_tokenizer(tmp_path, good):
    refused(
        tmp_path,
        good,
        r"tokenizer 'Qwen/Qwen3-30B-A3B' is not a local folder; download it first",
        tokenizer="Qwen/Qwen3-30B-A3B",
    )
    (tmp_path / "empty_tok").mkdir()
    refused(tmp_path, good, r"tokenizer folder .*empty_tok: cannot be loaded", tokenizer=str(tmp_path / "empty_tok"))
    refused(tmp_path, good, r"holds 'text' records; pass --tokenizer")
    with pytest.raises(DataError, match=r"source 'good' holds 'text' records but data.tokenizer is not set"):
        open_dataset(DataConfig(path=good), vocab_size=10)


def test_config(tmp_path, good):
    with pytest.raises(DataError, match=r"weight must be a number > 0, got 0; drop the source"):
        SourceConfig(good, weight=0)
    with pytest.raises(DataError, match=r"data.sources\[1\]: source .* weight must be a number > 0, got -1"):
        DataConfig.from_dict({"sources": [{"path": good}, {"path": good, "weight": -1, "name": "b"}]})
    with pytest.raises(
        DataError, match=r"unknown config key data.sources\[0\].wieght; did you mean data.sources\[0\].weight\?"
    ):
        DataConfig.from_dict({"sources": [{"path": good, "wieght": 1}]})
    with pytest.raises(DataError, match=r"unknown config key data.seqlen; did you mean data.seq_len\?"):
        DataConfig.from_dict({"path": good, "seqlen": 4})
    with pytest.raises(
        DataError, match=r"set exactly one of data.synthetic, data.path or data.sources \(got \['path', 'sources'\]\)"
    ):
        DataConfig(path=good, sources=[SourceConfig(good)])
    with pytest.raises(DataError, match=r"two sources are named 'good'"):
        DataConfig(sources=[SourceConfig(good), SourceConfig(good)])
    with pytest.raises(DataError, match=r"data.seq_len must be >= 2"):
        DataConfig(path=good, seq_len=1)
    with pytest.raises(DataError, match=r"data.packing must be true or false, got 'maybe'"):
        DataConfig.from_dict({"path": good, "packing": "maybe"})
    cfg = DataConfig.from_dict({"sources": [{"path": [good], "weight": 2}], "seq_len": 8})
    assert cfg.sources[0] == SourceConfig((good,), 2.0, "good")


def test_rows_and_outputs(tmp_path, write, good, tok_dir):
    t = str(tok_dir)
    with pytest.raises(
        DataError, match=r"source 'good': \d+ tokens make no row of data.seq_len 4096; add data or lower"
    ):
        open_dataset(DataConfig(path=good, tokenizer=t, seq_len=4096), vocab_size=1000)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("precious")
    with pytest.raises(DataError, match=r"out is not empty and holds no prepare.json; pass a new or empty folder"):
        prepare(good, tmp_path / "out", tokenizer=t, workers=1)
    assert os.listdir(tmp_path / "out") == ["mine.txt"]
    prepare(good, tmp_path / "p", tokenizer=t, workers=1)
    with pytest.raises(DataError, match=r"p holds a preparation with other options \(append_eos\); pass a new folder"):
        prepare(good, tmp_path / "p", tokenizer=t, workers=1, append_eos=False)
    with pytest.raises(DataError, match=r"p is already prepared; train on it directly"):
        prepare(str(tmp_path / "p"), tmp_path / "q", workers=1)
    with pytest.raises(DataError, match=r"source 'mix' mixes prepared folders .* and raw files"):
        open_dataset(
            DataConfig(sources=[{"path": [str(tmp_path / "p"), good], "name": "mix"}], tokenizer=t), vocab_size=1000
        )
