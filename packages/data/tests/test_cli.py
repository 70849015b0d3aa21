"""``python -m moeshard.data``: a bad input is one line ``moeshard.data: error: ...`` with status 2, an unexpected
error one line with status 1; ``inspect --rows`` decodes rows with their targets marked."""

from __future__ import annotations

import json

import pytest

from moeshard.data import ExitStatus
from moeshard.data._cli import main

PREFIX = "moeshard.data: error: "


def _one_line(capsys, argv: list[str], status: int) -> str:
    assert main(argv) == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(PREFIX) and "usage:" not in err, err
    return err.strip()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["prepare", "--input", "{tmp}/none.jsonl", "--output", "{tmp}/p"], "{tmp}/none.jsonl does not exist"),
        (["prepare", "--output", "{tmp}/p"], "the following arguments are required: --input"),
        (["inspect", "{tmp}"], "{tmp}: not a prepared folder"),
        (["inspect"], "the following arguments are required: folder"),
        (["nope"], "argument command: invalid choice: 'nope'"),
    ],
)
def test_bad_input_is_one_line_with_status_2(capsys, tmp_path, argv, needle):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert needle.format(tmp=tmp_path) in _one_line(capsys, argv, ExitStatus.USER_ERROR)


def test_unexpected_error_is_one_line_with_status_1(capsys, tmp_path, monkeypatch):
    import moeshard.data._prepare

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(moeshard.data._prepare, "prepare", broken)
    line = _one_line(capsys, ["prepare", "--input", "x", "--output", "y"], ExitStatus.FAILED)
    assert line == f"{PREFIX}KeyError: 'a bug' (unexpected; MOESHARD_TRACEBACK=1 shows the traceback)"


def _tokenizer(folder) -> None:
    """A word-level tokenizer saved as transformers saves one (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "hi", "there", "hello", "friend"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)


def test_inspect_rows_decodes_and_marks_the_targets(capsys, tmp_path):
    # input_ids/labels records: the loss mask is where labels are not -100 (prompt tokens carry no loss).
    records = [
        {"input_ids": [2, 4, 5, 3, 6, 7], "labels": [-100, -100, -100, -100, 6, 7]},
        {"input_ids": [2, 6, 3, 4], "labels": [-100, -100, -100, 4]},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _tokenizer(tmp_path / "tok")
    prep = ["prepare", "--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "p"), "--workers", "1"]
    assert main([*prep, "--tokenizer", str(tmp_path / "tok"), "--no-eos"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "p"), "--rows", "2"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    assert rows == [
        "[0] 6 tokens, 2 targets: <|user|> hi there <|assistant|>[[hello friend]]",
        "[1] 4 tokens, 1 targets: <|user|> hello <|assistant|>[[hi]]",
    ]
    # Without the tokenizer (moved away): token ids, the same marks.
    (tmp_path / "tok").rename(tmp_path / "gone")
    assert main(["inspect", str(tmp_path / "p"), "--rows", "1", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "token ids: the folder's tokenizer is not available here" in out
    assert "[0] 6 tokens, 2 targets: 2 4 5 3[[6]] ... (+1 tokens)" in out
