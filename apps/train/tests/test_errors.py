"""Bad inputs through the real entry point (in this process): one clear line each, exit status, nothing written.

Layout checks read torchrun's environment (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) and fail before any process group
exists, so a world of 16 is checked here without starting it; model and data errors run as a world of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moeshard.train.__main__ import main

TINY = ["--model.overrides.num_hidden_layers=2", "--data.seq_len=32", "--logging.progress_bar=false"]
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env():
    saved = dict(os.environ)
    for k in _DIST_ENV + ("MOESHARD_FAULT", "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    path = tmp_path_factory.mktemp("hf") / "tiny"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(get_preset_config("tiny", num_hidden_layers=2))
    model.init_weights()
    model.save_pretrained(path, expert_layout="fused")
    return path


def _copy_ckpt(src: Path, dst: Path, edit=None, truncate: bool = False) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1, files
    if edit is not None:
        tensors = load_file(files[0])
        edit(tensors)
        save_file(tensors, files[0], metadata={"format": "pt"})
    if truncate:
        data = files[0].read_bytes()
        files[0].write_bytes(data[: len(data) // 2])
    return dst


def _fail(capsys, args: list[str], code: int = 2) -> str:
    """Run the entry point, expect ``code`` and exactly one error line; return it."""
    assert main(args) == code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("moeshard-train: error")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize(
    ("env", "args", "needle"),
    [
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            ["--parallel.ep_size=3"],
            "ep_size 3 does not divide world size 4",
        ),
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
            ["--parallel.ep_size=4", "--model.overrides.num_experts=6"],
            "parallel.ep_size 4 does not divide the model's 6 experts",
        ),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, ["--parallel.ep_size=16"], "would cross a node boundary"),
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
            ["--train.global_batch_size=10"],
            "global_batch_size 10 is not divisible by the world size 4",
        ),
        ({}, ["--parallel.ep_size=1", "--train.micro_batch_size=3"], "not divisible by train.micro_batch_size 3"),
        (
            {},
            ["--parallel.ep_size=1", "--data.seq_len=300"],
            "data.seq_len 300 exceeds the model's max_position_embeddings 256",
        ),
        ({}, ["--parallel.ep_size=1", "--model.path=/nonexistent/model"], "/nonexistent/model does not exist"),
        ({}, ["--parallel.ep_size=1", "--model.overrides.no_such_field=1"], "no_such_field"),
    ],
)
def test_layout_and_model_errors(capsys, tmp_path, env, args, needle):
    os.environ.update({"RANK": "0", **env})
    out = tmp_path / "out"
    line = _fail(capsys, [*TINY, *args, f"--logging.output_dir={out}"], code=2)  # config errors, as plan's
    assert needle in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["--train.stepz=3"], "unknown config key train.stepz; did you mean train.steps?", 2),
        (["--train.steps=many"], "train.steps must be an integer, got 'many'", 2),
        (["--parallel.ep_size=2.5"], "parallel.ep_size must be an integer", 2),
        (["--data.path=/x.jsonl", "--data.synthetic=true"], "set exactly one of data.synthetic, data.path or", 2),
        (["--data.sources=[{path: /x, weight: 0}]"], "data.sources[0]: source '/x': weight must be a number > 0", 2),
    ],
)
def test_config_errors(capsys, args, needle, code):
    assert needle in _fail(capsys, args, code)


def test_other_architecture(capsys, tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama/config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    line = _fail(
        capsys,
        [*TINY, "--parallel.ep_size=1", f"--model.path={tmp_path / 'llama'}", f"--logging.output_dir={tmp_path / 'o'}"],
        code=2,  # model.path names a model this job cannot build: a config error, as plan and launch-local say
    )
    assert "model_type 'llama'" in line and "qwen3_moe" in line


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("missing", "is missing 1 tensor(s) the model needs"),
        ("extra", "has 1 tensor(s) this model does not have"),
        ("misshapen", "has shape [512, 32], the model needs [512, 64]"),
        ("truncated", "it is truncated or corrupt"),
    ],
)
def test_bad_safetensors(capsys, tmp_path, hf_dir, name, needle):
    edits = {
        "missing": lambda t: t.pop("model.norm.weight"),
        "extra": lambda t: t.__setitem__("model.layers.9.mlp.gate.weight", torch.zeros(8, 64)),
        "misshapen": lambda t: t.__setitem__("lm_head.weight", torch.zeros(512, 32)),
        "truncated": None,
    }
    bad = _copy_ckpt(hf_dir, tmp_path / name, edits[name], truncate=name == "truncated")
    out = tmp_path / "out"
    line = _fail(capsys, [*TINY, "--parallel.ep_size=1", f"--model.path={bad}", f"--logging.output_dir={out}"])
    assert needle in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("records", "extra", "needle"),
    [
        ([{"input_ids": [1, 2, 600, 3]}] * 20, [], "d.jsonl:1: token id 600 is outside the vocabulary [0, 512)"),
        ([], [], "source 'd': empty source"),
        ([{"input_ids": [1, 2, 3]}] * 5, [], "source 'd': 15 tokens make no row of data.seq_len 32"),
        ([{"text": "hello"}], [], "source 'd' holds 'text' records but data.tokenizer is not set"),
        ([{"input_ids": [1, 2]}], ["--data.path=nothere/*.jsonl"], "nothere/*.jsonl: the pattern matches no file"),
    ],
)
def test_bad_data(capsys, tmp_path, records, extra, needle):
    data = _jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "out"
    line = _fail(capsys, [*TINY, "--parallel.ep_size=1", f"--data.path={data}", *extra, f"--logging.output_dir={out}"])
    assert needle in line
    assert not out.exists()


def test_output_dir_guard_and_resume_checks(capsys, tmp_path):
    out = tmp_path / "run"
    base = [
        *TINY,
        "--parallel.ep_size=1",
        "--train.steps=2",
        "--train.global_batch_size=2",
        f"--logging.output_dir={out}",
    ]
    assert main([*base, "--logging.tensorboard=false"]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    line = _fail(capsys, [*base, "--train.lr=0.001"])
    assert "holds a different run (differs in train.lr)" in line and "nothing was overwritten" in line
    line = _fail(capsys, [*base, "--checkpoint.resume=none"])
    assert "already holds this run and checkpoint.resume is 'none'" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # An interrupted save (no COMPLETE marker) cannot be resumed explicitly; auto ignores it.
    tmp_ckpt = out / "checkpoints/.tmp-step_00000003"
    tmp_ckpt.mkdir()
    line = _fail(capsys, [*base, f"--checkpoint.resume={tmp_ckpt}", f"--logging.output_dir={tmp_path / 'new'}"])
    assert "is not a complete checkpoint (no COMPLETE marker)" in line
    assert main([*base, "--logging.tensorboard=false", "--train.steps=3"]) == 0  # auto: resumes step 2
    printed = capsys.readouterr().out
    assert "resumed from" in printed
    assert "resuming after step 2 with a changed schedule (train.steps 2 -> 3): the learning rate follows" in printed
    assert not tmp_ckpt.exists()  # the save of step 3 replaced our stale temporary folder
    # Restarted by torchrun, a run started with resume 'none' continues itself instead of refusing its own folder.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    assert main([*base, "--logging.tensorboard=false", "--train.steps=4", "--checkpoint.resume=none"]) == 0
    assert "resumed from" in capsys.readouterr().out
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # each step once (evaluations aside)


def test_resume_on_changed_data(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records = [{"input_ids": [(7 * i + j) % 500 for j in range(10 + i % 20)]} for i in range(40)]
    _jsonl(tmp_path / "d.jsonl", records)
    base = [*TINY, "--parallel.ep_size=1", "--train.global_batch_size=2", "--logging.tensorboard=false"]
    base += ["--checkpoint.every_steps=2", f"--logging.output_dir={tmp_path / 'run'}"]
    assert main([*base, "--data.path=d.jsonl", "--train.steps=2"]) == 0
    # The same file by its absolute path: the same run.
    assert main([*base, f"--data.path={tmp_path / 'd.jsonl'}", "--train.steps=3"]) == 0
    assert "resumed from" in capsys.readouterr().out
    # Half the records dropped: one line saying what changed and how to continue; nothing written.
    _jsonl(tmp_path / "d.jsonl", records[:20])
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    line = _fail(capsys, [*base, "--data.path=d.jsonl", "--train.steps=4"])
    assert "the data changed since the run in" in line and "source 'd' holds other content (40 -> 20 documents" in line
    assert "--data.allow_changed=true" in line
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    # Deliberately: logged, resumed, and the run now holds the new data.
    assert main([*base, "--data.path=d.jsonl", "--train.steps=4", "--data.allow_changed=true"]) == 0
    out = capsys.readouterr().out
    assert "warning: the data changed since the run in" in out and "resumed from" in out
    records = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "run/run.json").read_text())["data_content"]["d"]["documents"] == 20
