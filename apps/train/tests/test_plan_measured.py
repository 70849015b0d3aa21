"""``plan``'s estimate against peaks measured on one H100 80GB (``docs/performance.md``, "How close plan comes"):
the 30B-A3B geometry on one GPU at long rows, full fine-tuning and LoRA. The estimate never falls below a measured
peak (a job plan says fits must not run out of memory for what plan leaves out) and stays within each row's margin
(the rows that remain high, and why, are in that section)."""

from __future__ import annotations

import pytest

from moeshard.train.commands.plan import plan_report
from moeshard.train.commands.plan_memory import MemoryEstimate
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


def test_one_micro_batch_peak_is_the_larger_end_of_backward():
    # The first layer's backward holds its own activations beside every gradient but the embedding's; the last
    # layer's holds all that forward saved and no gradient. Each end wins where its part is the larger.
    common = dict(params=10, grads=40, optimizer=20, unsharded=1, loss_head=2, reduce_buffers=3, late_reduce_buffers=1)
    grads_heavy = MemoryEstimate(activations=30, first_layer=8, late_grads=36, **common)
    assert grads_heavy.backward_start == 32 and grads_heavy.backward_end == 45
    assert grads_heavy.total == 31 + 45
    saved_heavy = MemoryEstimate(activations=60, first_layer=8, late_grads=36, **common)
    assert saved_heavy.total == 31 + 62
    # once backward is over: every gradient and the largest stage's reduce buffers
    small_first = MemoryEstimate(activations=30, first_layer=0, late_grads=30, **common)
    assert small_first.backward_end == 43 and small_first.total == 31 + 43
    # several micro-batches: the earlier ones' gradients are alive beside the last one's saved activations
    several = MemoryEstimate(activations=30, first_layer=8, late_grads=36, micro_batches=2, **common)
    assert several.total == 31 + 40 + 32


def test_the_first_layer_end_counts_the_later_layers_gradients(monkeypatch):
    # 6 layers at 64k tokens: the first layer's end of backward is the peak, with every gradient but the embedding's
    monkeypatch.chdir(__file__.rsplit("/apps/", 1)[0])
    keys = ["--model.overrides.num_hidden_layers=6", "--data.seq_len=65536"]
    m = plan_report(load_config(_CONFIG, [*_BASE, *keys]), nnodes=1, nproc_per_node=1, table=False).memory
    embedding = 4 * 151936 * 2048  # the vocabulary's float32 gradient, formed after the first layer's
    assert m.late_grads == m.grads - embedding
    assert m.backward_end > m.backward_start
    assert m.total == m.params + m.optimizer + m.unsharded + m.first_layer + m.late_grads + m.late_reduce_buffers
