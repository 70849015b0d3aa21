"""GPT-OSS through the app: ``launch-local --nnodes 2 --nproc-per-node 2`` (EP 2 x ep_fsdp 2, gloo) trains the tiny
preset (sinks, a sliding and a full layer, biased experts), checkpoints, and its step-2 checkpoint resumes with the
uninterrupted run's step-3 loss; ``export-hf`` writes a bf16 folder transformers' ``GptOssForCausalLM`` loads with
every key and the logits ours gives from it; ``plan`` and ``bench`` run for the family on CPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from moeshard.meshes.testing import run_side_by_side

pytestmark = pytest.mark.slow  # 4-rank launches

FAMILY = ["--model.family=gpt_oss", "--model.preset=tiny"]
JOB = [
    *FAMILY,
    "--data.seq_len=32",  # rows longer than the window (8)
    "--train.steps=3",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=1",
    "--checkpoint.every_steps=2",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeshard.train", *args]


def _launch(out, *extra: str) -> list[str]:
    return _train(
        "launch-local", "--nnodes", "2", "--nproc-per-node", "2", "--", *JOB, f"--logging.output_dir={out}", *extra
    )


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _losses(out) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _ok(res) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "Traceback" not in res.stdout + res.stderr


def test_gpt_oss_job_trains_resumes_and_exports(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    bench = [*torchrun, "-m", "moeshard.train", "bench", *FAMILY, "--data.seq_len=32", "--parallel.ep_size=2"]
    plan = _train("plan", *FAMILY, "--nnodes", "2", "--nproc-per-node", "2", "--summary")
    a, b, p = run_side_by_side(
        _launch(tmp_path / "a"),
        [*bench, "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "bench.json")],
        plan,
        timeout=600,
        env=[_env()] * 3,
    )
    _ok(a)
    assert "world 4 = 2 node(s) x 2 ranks; ep 2 x ep_fsdp 2" in a.stdout
    _ok(b)
    bench_out = json.loads((tmp_path / "bench.json").read_text())
    assert len(bench_out["losses"]) == 3 and all(0 < x < 20 for x in bench_out["losses"])
    _ok(p)
    assert "ep 2 x ep_fsdp 2" in p.stdout and "estimated memory per rank" in p.stdout

    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    step3 = tmp_path / "a" / "checkpoints" / "step_00000003"
    (resumed,) = run_side_by_side(_launch(tmp_path / "b", f"--checkpoint.resume={step2}"), timeout=600, env=[_env()])
    _ok(resumed)
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(la) == [1, 2, 3] and sorted(lb) == [3]
    assert lb[3] == pytest.approx(la[3], rel=1e-5, abs=1e-6), (la, lb)

    from moeshard.train.__main__ import main

    assert main(["export-hf", "--checkpoint", str(step3), "--out", str(tmp_path / "hf")]) == 0
    from transformers import GptOssForCausalLM as HFGptOss

    from moeshard.models.gptoss import GptOssForCausalLM

    theirs, info = HFGptOss.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = GptOssForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    assert ours.model.layers[0].self_attn.sinks.abs().sum() > 0  # trained, not the zero init
