"""Background checkpoints (``checkpoint.async``) and Hub folders written during training (``checkpoint.save_hf``).

(``moeshard.checkpoint``'s own tests drive ``start_async_save`` / ``PendingSave`` directly.) These run the real
entry point in this process: the
step loop runs on while a save is still being written, each published checkpoint becomes a Hub folder that
transformers loads with the training model's logits and the tokenizer (given by a relative path) along, and an
injected write failure stops the job with one line and nothing published. ``bench --checkpoint-every`` reports the
step-time cost of a save.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from moeshard import checkpoint as ckpt
from moeshard.train.__main__ import main
from moeshard.train.run import faults

ONE = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--parallel.ep_size=1",
    "--train.global_batch_size=4",
    "--train.steps=4",
    "--checkpoint.every_steps=2",
    "--checkpoint.keep_last=5",
    "--checkpoint.async=true",
    "--logging.progress_bar=false",
    "--logging.tensorboard=false",
    "--logging.expert_load_every=0",
]


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


# ---- in a training run -------------------------------------------------------------------------------------------


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(100)}, "[UNK]": 100}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)


def test_async_run_goes_on_while_saving_and_writes_hub_folders(clean_env, capsys, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter
    from transformers import AutoModelForCausalLM

    from moeshard.train.export import load_full_model

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    _tokenizer(run_dir / "tok")
    out = tmp_path / "out"
    real_writer, overlapped = faults.Faults.storage_writer, []

    class WaitsForStep3(FileSystemWriter):
        def write_data(self, plan, planner):
            deadline = time.monotonic() + 60  # a slow disk: the write ends only once the loop finished step 3
            while 3 not in _steps(out) and time.monotonic() < deadline:
                time.sleep(0.01)
            overlapped.append(3 in _steps(out))
            return super().write_data(plan, planner)

    def writer(self, path, step):
        return WaitsForStep3(str(path)) if step == 2 else real_writer(self, path, step)

    monkeypatch.setattr(faults.Faults, "storage_writer", writer)
    monkeypatch.chdir(run_dir)  # data.tokenizer by a relative path
    hub = ["--checkpoint.save_hf=every", "--checkpoint.hf_dtype=float32", "--data.tokenizer=tok"]
    # 6 steps: two saves in the background (steps 2 and 4, each with a stager of its own), the last one in place
    assert main([*ONE, *hub, "--train.steps=6", f"--logging.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert overlapped == [True]  # step 3 ran while the checkpoint of step 2 was being written
    assert _steps(out) == [1, 2, 3, 4, 5, 6]
    ckpts = out / "checkpoints"
    names = ["step_00000002", "step_00000004", "step_00000006"]
    assert sorted(p.name for p in ckpts.iterdir()) == names
    for step in (2, 4, 6):
        ckpt.validate_checkpoint(ckpts / f"step_{step:08d}")
        folder = out / "hf" / f"step_{step:08d}"
        assert f"Hub folder {folder} written from checkpoint step_{step:08d} (float32)" in printed
        assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
        background = (
            f"checkpoint of step {step}: " in printed
            and "in the background)" in printed.split(f"checkpoint of step {step}: ")[1].splitlines()[0]
        )
        assert background == (step < 6), step
    assert sorted(p.name for p in (out / "hf").iterdir()) == names

    # transformers loads the Hub folder; its logits equal the training model's (the checkpoint, in float32)
    ours, _ = load_full_model(ckpts / "step_00000006")
    theirs = AutoModelForCausalLM.from_pretrained(out / "hf/step_00000006", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)

    # The run recorded the tokenizer's absolute path: export-hf from another folder still copies it.
    monkeypatch.chdir(elsewhere)
    assert main(["export-hf", "--checkpoint", str(ckpts / "step_00000002"), "--out", "exported"]) == 0
    assert (elsewhere / "exported/tokenizer.json").is_file()


def test_a_failed_background_save_stops_the_run_in_one_line(clean_env, capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv(faults.ENV, "enospc:0:during_save:2")
    assert main([*ONE, "--checkpoint.save_hf=every", f"--logging.output_dir={out}"]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("moeshard-train: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "saving the checkpoint of step 2 (in the background) failed (rank 0: OSError" in lines[0]
    assert "No space left on device" in lines[0] and "the previous checkpoint (none) is intact" in lines[0]
    assert _steps(out) == [1, 2, 3, 4]  # found at the next save, step 4's: the loop went on meanwhile
    assert not ckpt.complete_checkpoints(out / "checkpoints") and not (out / "hf").exists()
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_bench_reports_the_step_time_cost_of_a_save(clean_env, capsys, tmp_path):
    out, saves = tmp_path / "bench.json", tmp_path / "bench_checkpoints"
    args = ["bench", "--model.preset=tiny", "--model.overrides.num_hidden_layers=2", "--data.seq_len=32"]
    args += ["--batch-per-gpu", "2", "--steps", "6", "--warmup", "1", "--checkpoint-every", "2"]
    args += ["--checkpoint.async=true", "--checkpoint-dir", str(saves)]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # after steps 2, 4 and 6; the last one's next step is not run, so two costs
    assert result["checkpoint_every"] == 2 and result["async_checkpoint"] and len(result["save_cost_s"]) == 2
    assert result["step_time_s_median_without_save"] > 0 and result["save_cost_s_median"] is not None
    # each save's own figures: its blocking apart from the wait for the earlier write, its write time and rate
    assert [sv["step"] for sv in result["saves"]] == [2, 4, 6]
    for sv in result["saves"]:
        assert sv["blocking_s"] > 0 and sv["write_s"] > 0 and sv["write_gb_per_s_per_rank"] > 0
        assert sv["bytes_per_rank"] > 0 and sv["wait_for_previous_write_s"] >= 0
    assert result["saves"][0]["wait_for_previous_write_s"] == 0.0  # no earlier write
    printed = capsys.readouterr().out
    assert "checkpoint every 2 steps (async): step " in printed
    assert "  save after step 4: blocked " in printed and " s for the earlier write, staging " in printed
    assert not saves.exists()  # removed at the end
