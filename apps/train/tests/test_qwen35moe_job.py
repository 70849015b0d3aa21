"""The job with Qwen3.5-MoE (Gated DeltaNet beside gated attention): ``plan`` counts the DeltaNet's state and its
FLOPs; the tiny preset trains end to end under ``launch-local`` (2 nodes x 2 gloo ranks, EP 2 x ep_fsdp 2, packed
rows), resumes from its step-2 checkpoint with the same losses, exports a Hub folder that transformers loads with our
logits (and the run's validation loss), and ``bench`` runs its CPU path.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from moeshard.meshes.testing import run_side_by_side

FAMILY = ["--model.family=qwen3_5_moe_text", "--model.preset=tiny"]
JOB = [*FAMILY, "--data.seq_len=32", "--train.steps=4", "--checkpoint.every_steps=2"]


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "moeshard.train", *args]


def _plan(*overrides: str):
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    cfg = load_config(None, [*FAMILY, "--train.global_batch_size=8", *overrides])
    return plan_report(cfg, nnodes=1, nproc_per_node=2, table=False)


def test_plan_counts_the_delta_rule_state_and_flops():
    from moeshard.models.qwen35moe import FAMILY as QWEN35
    from moeshard.models.qwen35moe import get_preset_config

    # tiny: layers 0-2 Gated DeltaNet (H 4 value heads, Hk 2 key heads, Dk = Dv = 16, C = 2·2·16 + 4·16 = 128
    # convolution channels), layer 3 gated attention (4 query heads, 2 KV heads, head 16), D 64.
    facts = QWEN35.facts(get_preset_config("tiny"))
    # A DeltaNet layer: its modules' outputs in_proj_qkv 128, in_proj_z 64, in_proj_b 4, in_proj_a 4, the gated norm
    # 64, out_proj's input 64; what its kernels keep: the convolved q, k, v 128, the rule's output 64, the WY matrix
    # and the gates 4 x (64 + 4).
    deltanet = (128 + 64 + 4 + 4 + 64 + 64) + (128 + 64 + 4 * (64 + 4))
    # The attention layer: q_proj (with the gate) 128, q_norm 64, k_proj 32, k_norm 32, v_proj 32, o_proj's input 64,
    # and the query and keys the kernel reads, 64 + 32.
    attention = (128 + 64 + 32 + 32 + 32 + 64) + (64 + 32)
    assert facts.mixer_activations == 3 * deltanet + attention
    assert facts.attention_activations == deltanet  # the first MoE layer's: a DeltaNet
    assert facts.recurrent_state == 4 * 16 * 16 // 64  # one chunk's state [H, Dk, Dv] per 64 tokens

    report = _plan("--data.seq_len=1024", "--parallel.param_dtype=bfloat16")
    line = next(ln for ln in report.text.splitlines() if ln.startswith("FLOPs per token"))
    recurrent = 3 * 3 * 2 * 4 * (64 * (3 * 16 + 2 * 16) + 3 * 16 * 16)  # 3 x the forward, 3 DeltaNet layers
    attention_flops = 6 * 512 * 4 * (16 + 16)  # 6 x (S/2) x heads x (Dqk + Dv), the one attention layer
    assert f"causal attention {attention_flops / 1e9:.3f} G" in line
    assert f"recurrent state work {recurrent / 1e9:.3f} G" in line
    assert f"{facts.flops_per_token(1024) / 1e9:.3f} G at seq 1024" in line
    # Activations: the estimate grows with the DeltaNet's kept elements and its state, 2 bytes each (bf16), per token.
    tokens = 2 * 1024  # micro-batch 2 rows of 1024
    d, heads = 64, 4
    # an MoE layer as plan counts it (routed copies of top-2 of 8 experts of width 32, the gated shared expert)
    moe = 2 * (2 * d + 2 * (d + 3 * 32) + facts.mlp_activations) + 4 * (2 * 8 + 3 * 2)
    head = 2 * d * 2
    # once, one layer's expert pass in backward (moeshard.ep.backward_elements): each of the top-2 copies holds its
    # output's and input's gradients (D each) and its activation's and gate/up's (3F), 2 bytes each
    expert_backward = 2 * 2 * (2 * d + 3 * 32)
    per_token = 4 * (2 * 4 * d + 4 * heads + moe) + 2 * (3 * deltanet + attention) + 2 * 16 + head + expert_backward
    assert report.memory.activations == per_token * tokens


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_job_trains_resumes_exports_and_benches(tmp_path):
    launch = ["launch-local", "--nnodes", "2", "--nproc-per-node", "2", "--"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bench = [*FAMILY, "--model.overrides.num_hidden_layers=4", "--data.seq_len=32", "--parallel.ep_size=2"]
    first, benched = run_side_by_side(
        _train(*launch, *JOB, f"--logging.output_dir={tmp_path / 'a'}"),
        [*torchrun, "-m", "moeshard.train", "bench", *bench, "--steps", "3", "--warmup", "1"]
        + ["--out", str(tmp_path / "bench.json")],
        timeout=600,
        env=[env, env],
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "world 4 = 2 node(s) x 2 ranks; ep 2 x ep_fsdp 2" in first.stdout
    assert benched.returncode == 0, benched.stdout[-3000:] + benched.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert len(result["step_times_s"]) == 2 and len(result["losses"]) == 3
    assert all(0 < x < 20 for x in result["losses"]) and result["flops_per_token"] > 0

    step2, step4 = (tmp_path / f"a/checkpoints/step_0000000{s}" for s in (2, 4))
    resumed, exported = run_side_by_side(
        _train(*launch, *JOB, f"--logging.output_dir={tmp_path / 'b'}", f"--checkpoint.resume={step2}"),
        _train("export-hf", "--checkpoint", str(step4), "--out", str(tmp_path / "hf"), "--dtype", "float32"),
        timeout=600,
        env=[env, env],
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in _records(tmp_path / "a") if "loss" in r}
    again = {r["step"]: r["loss"] for r in _records(tmp_path / "b") if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4] and sorted(again) == [3, 4]
    assert [again[3], again[4]] == pytest.approx([losses[3], losses[4]], rel=1e-6)
    assert losses[4] < losses[1]

    # transformers loads the export; our model from it gives its logits, and the run's validation loss at step 4
    from transformers import Qwen3_5MoeForCausalLM as HFQwen35MoeForCausalLM

    from moeshard.data import EvalBatches, open_dataset
    from moeshard.models.common import evaluate
    from moeshard.models.qwen35moe import Qwen35MoeForCausalLM
    from moeshard.train.config import load_config
    from moeshard.train.run.data import eval_data_config

    hf = HFQwen35MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa")
    ours = Qwen35MoeForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 512, (2, 70), generator=torch.Generator().manual_seed(0))  # over a chunk of 64
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, rtol=0, atol=1e-5)
    cfg = load_config(None, JOB)
    data = open_dataset(eval_data_config(cfg), vocab_size=512, eos_id=None, pad_id=None)
    t = cfg.train
    batches = EvalBatches(
        data, global_batch=t.global_batch_size, world_size=1, micro_batch=2, max_batches=cfg.eval.max_batches
    )
    val = {r["step"]: r["val_loss"] for r in _records(tmp_path / "a") if "val_loss" in r}
    assert evaluate(ours, batches.rank_batches(0)).loss == pytest.approx(val[4], rel=1e-5)
