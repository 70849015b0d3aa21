"""An injected save failure (the folder rules are ``moeshard.checkpoint``'s tests), fault specs, and ``plan`` for the 30B preset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeshard import checkpoint as ckpt
from moeshard.train.errors import CheckpointSaveError
from moeshard.train.run import faults


@pytest.fixture
def world_of_one(tmp_path):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _save(d: Path, step: int, keep_last: int = 2, writer_factory=None) -> Path:
    state = {"model": {"w": torch.full((4,), float(step))}}
    extra, rank_state = {"step": step}, {"rng": torch.tensor(step)}
    saved = ckpt.save_checkpoint(d, step, state, extra, rank_state, keep_last=keep_last, writer_factory=writer_factory)
    return saved.path


def test_failed_save_keeps_the_previous_checkpoint(world_of_one, tmp_path, monkeypatch):
    d = tmp_path / "ckpts"
    _save(d, 2)
    plan = faults.Faults.from_env(tmp_path, 0, {faults.ENV: "enospc:0:during_save:4"})
    with pytest.raises(CheckpointSaveError, match=r"step 4 failed \(rank 0: OSError: \[Errno 28\] No space left"):
        _save(d, 4, writer_factory=plan.storage_writer)
    assert sorted(p.name for p in d.iterdir()) == ["step_00000002"]
    assert (tmp_path / ".faults_fired/enospc:0:during_save:4").is_file()
    _save(d, 4, writer_factory=plan.storage_writer)  # fired once: the retry (e.g. after a restart) succeeds
    assert ckpt.newest_checkpoint(d).name == "step_00000004"


def test_fault_specs():
    assert faults.parse("kill_rank:1:step:3, nan_loss:0:step:2") == [
        faults.Fault("kill_rank", 1, "step", 3),
        faults.Fault("nan_loss", 0, "step", 2),
    ]
    for bad in ("kill_rank:1:during_step:3", "nan_loss:0:during_save:1", "kill:1"):
        with pytest.raises(ValueError, match="MOESHARD_FAULT: cannot parse"):
            faults.parse(bad)


def test_plan_30b_on_two_nodes_of_eight(capsys):
    from moeshard.train.__main__ import main

    config = Path(__file__).resolve().parents[1] / "configs/qwen3_30b_a3b_2x8.yaml"
    assert main(["plan", "--config", str(config), "--nnodes", "2", "--nproc-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "world 16 = 2 node(s) x 8 ranks; ep 8 x ep_fsdp 2" in out
    assert "ep_fsdp  (experts dim 1):          [0,8], [1,9]" in out
    # The options the job builds with (parallel.compile: compiled attention; parallel.ep.kernels: triton).
    assert "dispatch=overlapped kernels=triton gemm=auto sm_carveout=32" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("model.layers.0.mlp.experts.down_proj "))
    assert row.split()[1:] == ["[128,", "2048,", "768]", "[16,", "1024,", "768]", "ep:Shard(0)x8", "ep_fsdp:S(1)x2"]
    embed = next(ln for ln in out.splitlines() if ln.startswith("model.embed_tokens.weight "))
    assert "[9496, 2048]" in embed and "fsdp:S(0)x16" in embed
    for key in ("params", "grads", "optimizer", "unsharded", "activations", "total"):
        assert any(ln.strip().startswith(key) and "GiB" in ln for ln in out.splitlines()), key
    assert "parameters: 30.532 B in total" in out
    for kind in ("all_gather       inter-node", "all_to_all       intra-node", "reduce_scatter   inter-node"):
        assert kind in out
    assert "all_to_all       inter-node" not in out  # EP stays inside a node


def _memory(*overrides: str, nproc: int = 2):
    from moeshard.train.commands.plan import plan_report
    from moeshard.train.config import load_config

    keys = ["model.preset=qwen3-30b-a3b", "model.overrides.num_hidden_layers=2", "parallel.param_dtype=bfloat16"]
    keys += ["data.seq_len=4096", "train.global_batch_size=8", "train.micro_batch_size=4", "parallel.ep_size=2"]
    cfg = load_config(None, keys + list(overrides))
    report = plan_report(cfg, nnodes=1, nproc_per_node=nproc, table=False)
    return report.memory, report.comm


def _numel(*overrides: str) -> int:
    """Elements of the model ``_memory`` plans (built on meta)."""
    from moeshard.train.config import load_config, resolve_model_config
    from moeshard.train.families import family_of

    keys = ["model.preset=qwen3-30b-a3b", "model.overrides.num_hidden_layers=2", *overrides]
    mcfg = resolve_model_config(load_config(None, keys))
    with torch.device("meta"):
        return sum(p.numel() for p in family_of(mcfg).model_class(mcfg).parameters())


def test_plan_memory_follows_the_policies():
    """What ``plan`` counts: experts under the fused update keep bf16 gradients; the loss head holds its float32
    ``[V, D]`` weight gradient and one chunk's bf16 logits and their gradient at the forward's end, when no
    reduce buffer is alive; gradients of earlier micro-batches sit beside the last one's activations; ``selective``
    drops 3F (``mlp``) or F (``activation``) bf16 elements per routed copy and layer and repeats no exchange,
    ``full`` keeps one hidden state per layer (and what ``keep_attention`` keeps) and does."""
    base, comm = _memory()
    experts = 2 * 128 // 2 * 3 * 2048 * 768  # 2 layers, 64 local experts: kept out of FSDP at EP 2 of 2 ranks
    unfused, _ = _memory("train.fuse_local_experts=false")
    assert unfused.grads - base.grads == 2 * experts  # float32 against bfloat16
    vocab, d = 151936, 2048
    assert base.loss_head == 4 * vocab * d + 2 * 4096 * vocab * 2  # a chunk of 4,096 of the 16,384 tokens
    assert base.reduce_buffers > 0  # the largest stage's float32 gradients (its local experts reduce nothing)
    saved = base.activations + base.loss_head
    assert base.micro_batches == 1 and base.total == base.params + base.optimizer + base.unsharded + max(
        saved, base.grads + base.reduce_buffers
    )
    accumulating, _ = _memory("train.micro_batch_size=2")
    assert accumulating.micro_batches == 2 and accumulating.activations * 2 == base.activations
    assert accumulating.loss_head == base.loss_head  # the same chunk
    assert accumulating.total == (
        base.params
        + base.optimizer
        + base.unsharded
        + accumulating.grads
        + max(accumulating.activations + accumulating.loss_head, accumulating.reduce_buffers)
    )
    short, _ = _memory("data.seq_len=1024", "train.micro_batch_size=2")  # 2,048 tokens: a chunk of them only
    assert short.loss_head == 4 * vocab * d + 2 * 2048 * vocab * 2
    once, once_comm = _memory("train.micro_batch_size=2", "train.gradient_sync=last_micro_batch")
    assert once.held_grads > 0 and once.total == accumulating.total + once.held_grads
    assert not once.loss_head_adds  # two chunks per micro-batch: the head writes its float32 product
    # One chunk per micro-batch with FSDP2 holding the head's gradient: the chunk's logit gradient is kept and its
    # product added in backward, no [V, D] float32 tensor (every micro-batch reducing: none held, the tensor is made)
    short_once, _ = _memory("data.seq_len=1024", "train.micro_batch_size=2", "train.gradient_sync=last_micro_batch")
    assert short_once.loss_head_adds and short_once.loss_head == 2 * 2048 * vocab * 2
    assert not short.loss_head_adds
    # The triton tier's loss kernel (compile on, bf16) writes each chunk's gradient over its logits: one [C, V] less
    over, _ = _memory("parallel.compile=true", "parallel.ep.kernels=triton")
    assert over.loss_head_over_logits and over.loss_head == base.loss_head - 4096 * vocab * 2
    assert not base.loss_head_over_logits and not _memory("parallel.ep.kernels=triton")[0].loss_head_over_logits
    over_once, _ = _memory(
        "data.seq_len=1024", "train.micro_batch_size=2", "train.gradient_sync=last_micro_batch",
        "parallel.compile=true", "parallel.ep.kernels=triton",
    )  # fmt: skip
    assert over_once.loss_head_adds and over_once.loss_head == 2048 * vocab * 2  # the kept gradient is the buffer
    _, accumulating_comm = _memory("train.micro_batch_size=2")
    for key, value in accumulating_comm.items():  # one reduce-scatter per step instead of one per micro-batch
        assert once_comm[key] == (value / 2 if key[0] == "reduce_scatter" else value), key
    tokens, copies = 4 * 4096, 8  # per micro-batch; top-8
    for recompute, width in (("mlp", 3 * 768), ("activation", 768)):
        selective, selective_comm = _memory(
            "parallel.activation_checkpointing=selective", f"parallel.selective_recompute={recompute}"
        )
        assert base.activations - selective.activations == tokens * 2 * 2 * copies * width  # 2 layers, bf16
        assert selective_comm == comm
    full, full_comm = _memory("parallel.activation_checkpointing=full")
    assert full.activations < selective.activations
    # keep_attention (the default): each layer also keeps its attention's output (32 heads x 128, bf16), the
    # log-sum-exp (32 float32) and the output projection's output (D, bf16)
    recomputed, _ = _memory("parallel.activation_checkpointing=full", "parallel.keep_attention=false")
    assert full.activations - recomputed.activations == tokens * 2 * ((32 * 128 + d) * 2 + 4 * 32)
    # the token rows travel 5 times instead of 4: out again in the recompute, which brings no outputs back and
    # replays the per-expert counts
    a2a = ("all_to_all", "intra-node")
    counts = 2 * 64 * 8  # 2 layers, the other rank's 64 experts, int64
    assert full_comm[a2a] - counts == pytest.approx(1.25 * (comm[a2a] - counts), rel=1e-9)


def test_plan_counts_kept_weight_gradient_factors():
    """Where ``train_step`` defers the local experts' weight gradients (more than one micro-batch) and their factors
    fit ``defer_expert_weight_grads``' budget, ``plan`` counts all but the last micro-batch's factors, ``(n - 1) ·
    tokens · top_k · (2D + 3F)`` bf16 elements per MoE layer, instead of the gradients; where they do not fit (64
    local experts at EP 2, the overlapped dispatcher: 2.75x the gradients), the gradients."""
    one, _ = _memory("parallel.ep_size=1", "train.global_batch_size=4", nproc=1)  # 128 local experts, one micro-batch
    kept, _ = _memory("parallel.ep_size=1", "train.global_batch_size=4", "train.micro_batch_size=1", nproc=1)
    assert one.micro_batches == 1 and kept.micro_batches == 4
    gradients = 2 * 128 * 3 * 2048 * 768 * 2  # 2 layers, bf16
    factors = 2 * 3 * 4096 * 8 * (2 * 2048 + 3 * 768) * 2
    assert kept.grads - one.grads == factors - gradients and factors < 1.1 * gradients
    base, _ = _memory()
    over, _ = _memory("train.micro_batch_size=1")
    assert over.micro_batches == 4 and over.grads == base.grads


def test_plan_counts_the_expert_units_options():
    """EP 1 x ep_fsdp 2 (experts are FSDP units): experts not resharded after forward keep their bf16 copies through
    the step and are gathered once per micro-batch; a bf16 reduce-scatter halves their reduce-scatter bytes, their
    reduce buffers and the unsharded gradients held under ``last_micro_batch``."""
    ep1 = "parallel.ep_size=1"
    base, comm = _memory(ep1)
    experts = 2 * 128 * 3 * 2048 * 768  # 2 layers' experts, gathered whole on each rank (one micro-batch)
    ag, rs = ("all_gather", "intra-node"), ("reduce_scatter", "intra-node")
    kept, kept_comm = _memory(ep1, "parallel.expert_reshard_after_forward=false")
    assert comm[ag] - kept_comm[ag] == pytest.approx(experts)  # 2 bytes x 1/2 sent, once instead of twice
    assert {k: v for k, v in kept_comm.items() if k != ag} == {k: v for k, v in comm.items() if k != ag}
    # With every unit kept gathered (parallel.reshard_after_forward, which the experts follow by default), every
    # unit's bf16 copy lives through the step: the whole model, at EP 1, on each rank.
    followed, followed_comm = _memory(ep1, "parallel.reshard_after_forward=false")
    assert followed.unsharded == 2 * _numel(ep1) and followed_comm[ag] < kept_comm[ag]
    # Keeping the experts' bf16 copies costs memory, at most what keeping every unit's costs: each is counted
    # once, not again among the stages in flight.
    assert base.unsharded < kept.unsharded <= followed.unsharded
    bf16, bf16_comm = _memory(ep1, "parallel.expert_reduce_dtype=bfloat16")
    assert comm[rs] - bf16_comm[rs] == pytest.approx(experts)  # 4 -> 2 bytes x 1/2 sent
    assert {k: v for k, v in bf16_comm.items() if k != rs} == {k: v for k, v in comm.items() if k != rs}
    assert base.reduce_buffers - bf16.reduce_buffers == experts  # one layer's expert reduce buffers, 4 -> 2 bytes
    once = ("train.micro_batch_size=2", "train.gradient_sync=last_micro_batch")
    held, held_bf16 = _memory(ep1, *once)[0], _memory(ep1, *once, "parallel.expert_reduce_dtype=bfloat16")[0]
    # the unsharded gradients beyond the shard already counted: (n - 1) / n of them, a half at ep_fsdp 2
    assert held.held_grads - held_bf16.held_grads == 2 * experts // 2


def test_plan_refuses_a_layout_that_does_not_fit(capsys):
    from moeshard.train.__main__ import main

    assert main(["plan", "--nnodes", "2", "--nproc-per-node", "2", "--parallel.ep_size=4"]) == 2
    assert "would cross a node boundary" in capsys.readouterr().err


def test_comm_accounting_counts_per_group(tmp_path):
    from moeshard.meshes.testing import run_distributed

    out = run_distributed(_comm_body, 4, ranks_per_node=2)
    snap = out[0]
    # all_gather_single of 16 floats over 4 ranks (2 nodes): 3 peers x 64 B, 2 of them on the other node.
    assert snap["all_gather/world"] == {"calls": 1, "bytes": 192.0, "inter_node_bytes": 128.0, "max_call_bytes": 192.0}
    # all_to_all_single with uneven splits inside the node group [0, 1]: rank 0 sends 3 rows of 8 B to rank 1.
    assert snap["all_to_all/node"]["bytes"] == 24.0 and snap["all_to_all/node"]["inter_node_bytes"] == 0.0
    assert snap["reduce_scatter/world"]["bytes"] == 3 * 16.0  # a 64 B chunk of 16 B per peer
    assert snap["all_reduce/world"]["bytes"] == 2 * 3 / 4 * 8  # ring: 2 (n-1)/n S
    assert "barrier/world" not in snap  # paused


def _comm_body():
    from moeshard.train.observe.comm_accounting import CommAccounting

    rank = dist.get_rank()
    node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    acct = CommAccounting(dict.fromkeys(node_groups, "node"), ranks_per_node=2)
    with acct:  # looked up inside, as FSDP2 does (torch 2.13 names; *_into_tensor / *_tensor before)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather(torch.empty(16 * 4), torch.ones(16))
        x = torch.arange(4, dtype=torch.float64)
        send, recv = ([1, 3], [1, 2]) if rank % 2 == 0 else ([2, 2], [3, 2])
        out = torch.empty(sum(recv), dtype=torch.float64)
        dist.all_to_all_single(out, x, recv, send, group=node_groups[rank // 2])
        reduce_scatter(torch.empty(4), torch.ones(16))
        dist.all_reduce(torch.ones(2))
        with acct.paused():
            dist.barrier()
    return acct.snapshot() if rank == 0 else None


# The config a checkpoint of moeshard-train 0.4.16 holds (`extra["config"]`, JobConfig.to_dict() of that release for
# configs/qwen3_30b_a3b_2x8.yaml with --parallel.ep.dispatch=all_to_all --parallel.activation_checkpointing=true):
# parallel's mesh keys first, no parallel.ep.recompute, the checkpointing switch stored as written.
CONFIG_0_4_16 = {
    "model": {"family": None, "preset": "qwen3-30b-a3b", "path": None, "overrides": {}, "init_seed": 0},
    "parallel": {
        "ep_size": 8,
        "allow_cross_node_ep": False,
        "ep": {"dispatch": "all_to_all", "kernels": "triton", "gemm": "auto", "sm_carveout": 32},
        "compile": True,
        "activation_checkpointing": True,
        "keep_attention": True,
        "attention_kernel": "sdpa",
        "selective_recompute": "activation",
        "param_dtype": "bfloat16",
        "reshard_after_forward": None,
        "expert_reduce_dtype": "float32",
        "expert_reshard_after_forward": None,
        "prefetch_depth": 1,
        "prefetch_at_host_sync": True,
    },
    "data": {
        "path": "/data/train.jsonl",
        "sources": [],
        "tokenizer": "/models/Qwen3-30B-A3B",
        "seq_len": 4096,
        "packing": True,
        "shuffle": True,
        "seed": 0,
        "synthetic": False,
        "synthetic_samples": 4096,
        "allow_changed": False,
    },
    "eval": {"path": None, "synthetic": False, "every_steps": 20, "max_batches": 2, "at_start": True},
    "train": {
        "steps": 1000,
        "global_batch_size": 64,
        "micro_batch_size": 1,
        "lr": 0.0001,
        "warmup_steps": 50,
        "schedule": "cosine",
        "min_lr": 1e-05,
        "decay_fraction": 0.1,
        "decay_shape": "linear",
        "weight_decay": 0.01,
        "betas": [0.9, 0.95],
        "max_grad_norm": 1.0,
        "seed": 0,
        "fuse_local_experts": True,
        "gradient_sync": "auto",
        "expert_weight_grads": "auto",
        "aux_loss": {"coef": None, "scope": "micro_batch"},
        "router_bias": None,
        "z_loss_coef": 0.0,
        "timeout_s": 100.0,
        "init_timeout_s": 300.0,
    },
    "checkpoint": {
        "dir": None,
        "every_steps": 200,
        "save_final": True,
        "keep_last": 3,
        "resume": "auto",
        "async": False,
        "save_hf": "none",
        "hf_dtype": "bfloat16",
    },
    "logging": {
        "output_dir": "outputs/qwen3-30b-a3b-2x8",
        "every_steps": 1,
        "tensorboard": True,
        "expert_load_every": 10,
        "comm_accounting": False,
        "progress_bar": True,
        "wandb": None,
        "mlflow": None,
        "profile": None,
    },
}


def test_a_checkpoint_of_0_4_resumes_and_exports_with_its_config(world_of_one, tmp_path):
    """What a resume reads of a 0.4.16 checkpoint's saved config (its train section, for the schedule) and what an
    export reads (all of it) is the job those keys name now."""
    from moeshard.train.config import config_from_dict, load_config, parallel_options
    from moeshard.train.export import _Run
    from moeshard.train.run import schedule_change

    state = {"model": {"w": torch.zeros(4)}}
    extra = {"step": 200, "config": CONFIG_0_4_16}
    saved = ckpt.save_checkpoint(tmp_path, 200, state, extra, {"rng": torch.tensor(0)}, keep_last=2).path
    now = load_config(
        Path(__file__).parents[1] / "configs" / "qwen3_30b_a3b_2x8.yaml",
        ["--parallel.ep.dispatch=all_to_all", "--parallel.activation_checkpointing=full"],
    )
    extra = ckpt.read_extra(saved)
    assert schedule_change(extra["config"]["train"], now, 200) is None  # job.py: the resume goes on unchanged
    assert config_from_dict(extra["config"]) == now
    run = _Run(saved)  # export
    cfg, model_config = run.cfg, run.model_config
    assert cfg == now and parallel_options(cfg).activation_checkpointing == "full"
    assert cfg.parallel.ep.dispatch == "all_to_all" and model_config.num_experts == 128
