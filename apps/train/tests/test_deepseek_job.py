"""The default CPU job's DeepSeek-V3 twin: ``--model.family=deepseek_v3`` on the tiny preset's geometry, 2 "nodes" x 2
ranks (EP 2 x ep_fsdp 2, gloo), against single-process transformers training on the same global batches, and its
step-2 checkpoint resumed at EP 4 x ep_fsdp 1.

The tiny preset's model (query LoRA, 4 expert groups of which 2 are kept, a shared expert, a dense first layer,
YaRN RoPE, sigmoid scores with non-zero correction biases, routed_scaling_factor 2.5) is saved by transformers so that
both sides start from the same weights; its folder's ``model_type`` would pick the family too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from moeshard.meshes.testing import run_distributed

STEPS = 4


def _cfg(paths: dict, out: str, *extra: str):
    from moeshard.train.config import load_config

    return load_config(
        None,
        [
            "--model.family=deepseek_v3",
            f"--model.path={paths['hf']}",
            f"--data.path={paths['data']}",
            "--data.packing=false",
            "--data.seq_len=32",
            f"--train.steps={STEPS}",
            "--train.global_batch_size=8",
            "--train.micro_batch_size=1",
            "--train.lr=1e-3",
            "--train.warmup_steps=2",
            "--train.max_grad_norm=0.5",
            "--checkpoint.every_steps=2",
            "--logging.tensorboard=false",
            "--logging.progress_bar=false",
            "--logging.expert_load_every=0",
            f"--logging.output_dir={paths['root']}/{out}",
            *extra,
        ],
    )


def _four_ranks(paths: dict) -> dict:
    import os

    from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM
    from moeshard.train.job import run_job

    out = run_job(_cfg(paths, "a"))
    step2 = f"{paths['root']}/a/checkpoints/step_00000002"
    os.environ["LOCAL_WORLD_SIZE"] = "4"  # one node of 4: EP 4 x ep_fsdp 1
    resumed = run_job(_cfg(paths, "c", "--parallel.ep_size=4", f"--checkpoint.resume={step2}"))
    return {
        "losses": out["losses"],
        "layout": out["job"].meshes.describe(),
        "family": isinstance(out["job"].model, DeepseekV3ForCausalLM),
        "resumed": (resumed["start_step"], resumed["losses"], resumed["job"].meshes.describe()),
    }


def _reference(paths: dict) -> tuple[list[float], list[float]]:
    """transformers' DeepseekV3ForCausalLM trained in one process on the same global batches (AdamW, the job's
    schedule and clipping); the loss is the token-loss sum over the label tokens."""
    from transformers import DeepseekV3ForCausalLM

    from moeshard.data import StepBatches, open_dataset
    from moeshard.train.run import lr_at

    cfg = _cfg(paths, "unused")
    model = DeepseekV3ForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    mc = model.config
    data = open_dataset(cfg.data, vocab_size=mc.vocab_size, eos_id=mc.eos_token_id, pad_id=mc.pad_token_id)
    batches = StepBatches(data, global_batch=8, world_size=1, micro_batch=8)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / t.lr)
    losses, norms = [], []
    for step in range(STEPS):
        b = batches.global_batch(step)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
        targets = b.labels[:, 1:]
        loss = (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
            )
            / (targets != -100).sum()
        )
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from transformers import DeepseekV3ForCausalLM

    from moeshard.models.deepseekv3 import get_preset_config

    root = tmp_path_factory.mktemp("deepseek_job")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(get_preset_config("tiny", pad_token_id=0))
    with torch.no_grad():  # biases that change the selection, as a trained model's do
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(root / "hf")
    rng = random.Random(0)
    records = [{"input_ids": [rng.randrange(1, 512) for _ in range(rng.randint(3, 45))]} for _ in range(20)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"hf": str(root / "hf"), "data": str(root / "data.jsonl"), "root": str(root)}


def test_deepseek_v3_on_two_nodes_of_two_equals_transformers(paths):
    four = run_distributed(_four_ranks, 4, paths, ranks_per_node=2, timeout=400)[0]
    assert four["family"] and "ep 2 x ep_fsdp 2" in four["layout"]
    ref_losses, ref_norms = _reference(paths)
    norms = [
        json.loads(line)["grad_norm"] for line in (Path(paths["root"]) / "a/metrics.jsonl").read_text().splitlines()
    ]
    assert four["losses"] == pytest.approx(ref_losses, rel=1e-6)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(ref_norms) > 0.5  # clipping was active
    # Resumed at another layout (EP 4 x ep_fsdp 1) from step 2: the same training as uninterrupted.
    start, losses, layout = four["resumed"]
    assert start == 2 and "ep 4 x ep_fsdp 1" in layout
    assert losses == pytest.approx(four["losses"][2:], rel=1e-6)
