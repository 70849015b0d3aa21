"""``plan`` with LoRA: the frozen base once in the compute dtype, the adapters with float32 masters, gradients and
AdamW's moments, against the state of a real job (a world of one on CPU) and on the 30B preset."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

LORA = [
    "--lora.rank=4",
    "--lora.target_modules=[q_proj,o_proj]",
    "--lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
]
TINY_JOB = [
    "--parallel.ep_size=1",
    "--parallel.param_dtype=float32",  # what the CPU computes in: the frozen base is float32 there
    "--data.seq_len=16",
    "--data.synthetic_samples=64",
    "--train.steps=1",
    "--train.global_batch_size=2",
    "--train.micro_batch_size=1",
    "--checkpoint.every_steps=0",
    "--eval.every_steps=0",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


@pytest.mark.parametrize(
    "fuse,dtype",
    [(True, "float32"), (False, "float32"), (True, "bfloat16")],
    ids=["fused", "torch-adamw", "fused-bf16"],
)
def test_plan_counts_the_state_of_a_lora_job(tmp_path, fuse, dtype):
    """A world-of-one job with adapters on attention and the experts, after one step: its parameters' bytes (the
    frozen base and the adapters) and its optimizer's state bytes (every tensor but the step counters) are what
    ``plan`` estimates for the same config, and what trains is the adapters ``plan`` counts. The fused update's
    expert adapters: their parameter is (part of) the master, counted in ``params``, with no compute copy in
    ``unsharded``."""
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config
    from moeshard.train.job import run_job

    extra = [f"--train.fuse_local_experts={str(fuse).lower()}", f"--logging.output_dir={tmp_path}"]
    extra.append(f"--parallel.param_dtype={dtype}")
    cfg = load_config(None, [*LORA, *TINY_JOB, *extra])
    report = plan_report(cfg, nnodes=1, nproc_per_node=1, table=False)  # the fake backend: before the real group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        job = run_job(cfg)["job"]
    finally:
        dist.destroy_process_group()

    params = list(job.model.parameters())
    trained = [p for p in params if p.requires_grad]
    assert trained and len(trained) < len(params)
    states = {id(p): st for o in job.optimizer.optimizers for p, st in o.state.items()}
    assert set(states) == {id(p) for p in trained}  # the optimizer holds the adapters only
    # The fused update of experts outside FSDP keeps their float32 master in its state and the parameter is the
    # compute copy (plan counts those with the compute copies); elsewhere the parameter is the master.
    masters = [t for st in states.values() for k, t in st.items() if k in ("master", "master_low")]
    assert bool(masters) == fuse
    # Every tensor the parameters and the masters hold, each storage once (a float32 master is the parameter).
    storages = {_local(t).untyped_storage().data_ptr(): _bytes(t) for t in [*params, *masters]}
    assert report.memory.params == sum(storages.values())  # the frozen base in the compute dtype, the masters whole
    compute = 2 if dtype == "bfloat16" else 4
    frozen = sum(_local(p).numel() for p in params if not p.requires_grad)
    assert sum(_bytes(p) for p in params if not p.requires_grad) == compute * frozen
    experts = sum(_local(job.model.get_parameter(n)).numel() for t in job.adapters.targets if t.kind == "experts"
                  for n in (t.a_name, t.b_name))  # fmt: skip
    if fuse:  # the expert adapters are the fused pass's: no cast copy (their parameters, counted above, are it)
        unfused = plan_report(load_config(None, [*LORA, *TINY_JOB, *extra, "--train.fuse_local_experts=false"]),
                              nnodes=1, nproc_per_node=1, table=False)  # fmt: skip
        assert unfused.memory.unsharded - report.memory.unsharded == compute * experts
        assert unfused.memory.params == report.memory.params
    moments = [t for st in states.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert report.memory.optimizer == sum(_bytes(t) for t in moments)  # AdamW's two float32 moments, adapters only
    assert report.memory.optimizer == 8 * sum(_local(p).numel() for p in trained)
    fused_grads = (compute - 4) * experts if fuse else 0  # the fused pass's gradients are in the compute dtype
    assert report.memory.grads == 4 * sum(_local(p).numel() for p in trained) + fused_grads
    adapters = sum(_local(job.model.get_parameter(n)).numel() for n in job.adapters.names())
    assert f"adapter parameters: {adapters / 1e6:.2f} M in total" in report.text
    assert "lora: rank 4" in report.text and "(8 linear modules, 8 expert tensors)" in report.text
    assert "the frozen head has no weight gradient" in report.text


def _plan(*overrides: str, nproc: int = 8):
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    keys = ["--model.preset=qwen3-30b-a3b", "--model.overrides.num_hidden_layers=2", "--parallel.param_dtype=bfloat16"]
    keys += ["--data.seq_len=4096", "--train.global_batch_size=8", "--train.micro_batch_size=1"]
    keys += ["--parallel.ep_size=8", "--parallel.activation_checkpointing=full"]
    return plan_report(load_config(None, keys + list(overrides)), nnodes=1, nproc_per_node=nproc, table=False)


def test_lora_holds_the_base_once_in_bf16_and_trains_only_the_adapters():
    """On 2 layers of the 30B at EP 8: the base's bytes are 2 per element (no master, gradient or moments), the
    adapters' 16 (4 master + 4 gradient + 8 AdamW); nothing of the base is reduced; the linear adapters keep r
    elements per token of the recomputed layer; the expert adapters keep none (recomputed in backward)."""
    full = _plan()
    lora = _plan(*LORA)
    rank = 4
    d, heads, hd, experts, width, layers = 2048, 32, 128, 128, 768, 2
    q, o = (d, rank, heads * hd), (heads * hd, rank, d)  # (in, r, out) per linear target
    linear = layers * sum(i * r + r * o for i, r, o in (q, o))
    expert = layers * experts * (rank * d + 2 * width * rank + rank * width + d * rank)  # gate_up, down: A and B
    assert lora.text.count("adapter parameters: ") == 1
    assert f"{(linear + expert) / 1e6:.2f} M in total" in lora.text
    # The base: its rank's elements at 2 bytes (full fine-tuning holds 4 of master, 4 of gradient, 8 of moments).
    local_base = full.memory.optimizer // 8
    assert lora.memory.optimizer < full.memory.optimizer / 50
    trained_local = lora.memory.optimizer // 8
    # the expert adapters (EP 8: kept out of FSDP, the fused update) hold their 4 bytes of master as the bf16
    # parameter (its high half, which is also the compute copy) and 2 bytes of low halves
    assert lora.memory.params == 2 * local_base + 4 * trained_local
    assert lora.memory.reduce_buffers < full.memory.reduce_buffers / 50
    assert lora.memory.loss_head == 2 * 4096 * 151936 * 2  # a chunk's logits and gradient, no [V, D] gradient
    extras = 2 * rank * 2 * 4096  # q_proj and o_proj of the one recomputed layer, bf16, per token
    # and the gate/up delta's input gradients in the expert pass's backward (top-8 copies of D, twice), bf16
    extras += 8 * 2 * d * 2 * 4096
    assert lora.memory.activations - full.memory.activations == extras
    # The local experts are their own compute copies in both (a frozen base; the fused update's parameters): LoRA
    # gathers the linear adapters beside the base's units, in bf16, at most all of them.
    assert 0 < lora.memory.unsharded - full.memory.unsharded <= 2 * linear
    assert lora.memory.total < full.memory.total


def test_lora_reduce_scatters_only_the_adapters_gradients():
    """2 nodes x 8 (EP 8 x ep_fsdp 2), 2 layers of the 30B: the reduce-scatter of a LoRA step carries the adapters'
    float32 gradients only (the frozen base has none), over all 16 ranks outside the experts and over the 2 ep_fsdp
    ranks for this EP rank's expert adapters; the all-gather carries the base and the adapters."""
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    keys = ["--model.preset=qwen3-30b-a3b", "--model.overrides.num_hidden_layers=2", "--parallel.param_dtype=bfloat16"]
    keys += ["--data.seq_len=4096", "--train.global_batch_size=16", "--train.micro_batch_size=1"]
    keys += ["--parallel.ep_size=8", "--parallel.activation_checkpointing=full"]

    def comm(*extra: str) -> dict:
        report = plan_report(load_config(None, keys + list(extra)), nnodes=2, nproc_per_node=8, table=False)
        return {kind: sum(b for (k, _), b in report.comm.items() if k == kind) for kind, _ in report.comm}

    full, lora = comm(), comm(*LORA)
    rank, d, heads, hd, experts, width, layers = 4, 2048, 32, 128, 128, 768, 2
    linear = layers * sum(i * rank + rank * o for i, o in ((d, heads * hd), (heads * hd, d)))  # q_proj, o_proj
    expert = layers * experts * (rank * d + 2 * width * rank + rank * width + d * rank)  # gate_up, down: A and B
    want = linear * 4 * 15 / 16 + expert / 8 * 4 * 1 / 2  # one micro-batch per rank: one reduce-scatter
    assert lora["reduce_scatter"] == pytest.approx(want, rel=1e-9)
    assert lora["reduce_scatter"] < full["reduce_scatter"] / 50
    # the all-gather: the base as full fine-tuning gathers it, plus the adapters (in the compute dtype)
    assert lora["all_gather"] > full["all_gather"]
    assert lora["all_gather"] - full["all_gather"] < 2 * (linear + expert / 8) * 2
    assert lora["all_to_all"] == full["all_to_all"]


def test_plan_counts_what_lora_dropout_keeps():
    """With ``lora.dropout`` each linear adapter also keeps its dropped input (compute dtype) and the mask (a byte)
    per element of its input, for every token of the micro-batch (no checkpointing: every layer's)."""
    from moeshard.models.qwen3moe import get_preset_config
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    keys = ["--lora.rank=4", "--lora.target_modules=[q_proj,o_proj]", "--parallel.activation_checkpointing=none"]
    keys += ["--data.seq_len=16", "--train.global_batch_size=2", "--train.micro_batch_size=1"]
    plain, dropped = (
        plan_report(load_config(None, [*keys, *extra]), nnodes=1, nproc_per_node=2, table=False).memory
        for extra in ([], ["--lora.dropout=0.1"])
    )
    c = get_preset_config("tiny")
    inputs = c.num_hidden_layers * (c.hidden_size + c.num_attention_heads * c.head_dim)  # q_proj's and o_proj's
    assert dropped.activations - plain.activations == 16 * inputs * (2 + 1)  # bf16 and a byte, 16 tokens
