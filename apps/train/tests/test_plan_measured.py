"""``plan``'s estimate against peaks measured on one H100 80GB (``docs/performance.md``, "How close plan comes"):
the 30B-A3B geometry on one GPU at long rows, full fine-tuning and LoRA. The estimate never falls below a measured
peak (a job plan says fits must not run out of memory for what plan leaves out) and stays within each row's margin
(the rows that remain high, and why, are in that section)."""

from __future__ import annotations

import pytest

from moeshard.train.commands.plan import plan_report
from moeshard.train.config import load_config

_CONFIG = "apps/train/configs/qwen3_30b_a3b_8l_1gpu.yaml"
_BASE = [
    "--parallel.compile=true",
    "--parallel.ep.kernels=triton",
    "--model.overrides.max_position_embeddings=131072",
    "--train.global_batch_size=1",
    "--train.micro_batch_size=1",
    "--parallel.activation_checkpointing=full",
]
_LORA = [
    "--lora.rank=16",
    "--lora.alpha=32",
    "--lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "--lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
]
# (keys, the measured peak allocated in GiB, how far above it plan may be)
_ROWS = [
    (["--model.overrides.num_hidden_layers=4", "--data.seq_len=65536"], 55.02, 0.05),
    (["--model.overrides.num_hidden_layers=4", "--data.seq_len=131072"], 71.30, 0.08),
    (["--model.overrides.num_hidden_layers=6", "--data.seq_len=131072", *_LORA], 55.05, 0.12),
    (["--model.overrides.num_hidden_layers=6", "--data.seq_len=32768", "--train.global_batch_size=4"], 69.09, 0.05),
    (
        [
            "--model.overrides.num_hidden_layers=6",
            "--data.seq_len=4096",
            "--train.global_batch_size=4",
            "--train.micro_batch_size=4",
            "--parallel.activation_checkpointing=none",
        ],
        64.01,
        0.05,
    ),
]


@pytest.mark.parametrize(
    "keys,measured,margin", _ROWS, ids=["4l-64k", "4l-128k", "6l-128k-lora", "6l-32k-x4", "6l-4k-mb4"]
)
def test_plan_holds_the_measured_peaks(monkeypatch, keys, measured, margin):
    monkeypatch.chdir(__file__.rsplit("/apps/", 1)[0])
    cfg = load_config(_CONFIG, [*_BASE, *keys])
    total = plan_report(cfg, nnodes=1, nproc_per_node=1, table=False, gpu_memory=None).memory.total / 2**30
    assert measured <= total <= measured * (1 + margin), (total, measured)
