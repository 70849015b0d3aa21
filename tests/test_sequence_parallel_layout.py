"""Sequence parallelism inside the full layout (``parallelize`` with ``sp_size``: EP, FSDP2 over every rank, the
attention on head shards) on 4 gloo ranks, against one process on the same global batch of packed rows: the tiny
Qwen3-MoE at sp 2 x ep 2 (two data-parallel groups) and at sp 4 (one group; 2 key/value heads for 4 shards).

The loss is the mean over every target of the global batch plus the micro-batch aux loss of each data-parallel
group's whole rows (``Balancing`` with the sequence group); its value and every parameter's gradient equal one
process's. The one-process reference is our model, which ``tests/test_fsdp_moe_qwen3moe_dist.py`` holds to
transformers; here transformers' loss on the rows without packing is checked too."""

import pytest
import torch

from moeshard.meshes.testing import run_distributed

SEQ, ROWS, AUX = 16, 4, 0.01


def _rows(vocab: int):
    """4 rows of 16 tokens cut into documents (positions restart; a piece's first token is no target)."""
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    starts = [[0, 5, 13], [0, 2, 3, 11], [0, 9], [0]]
    document_ids = torch.zeros(ROWS, SEQ, dtype=torch.int32)
    position_ids = torch.zeros(ROWS, SEQ, dtype=torch.int64)
    labels = input_ids.clone()
    for b, row in enumerate(starts):
        for d, (start, stop) in enumerate(zip(row, row[1:] + [SEQ])):
            document_ids[b, start:stop] = d
            position_ids[b, start:stop] = torch.arange(stop - start)
            labels[b, start] = -100
    return input_ids, labels, position_ids, document_ids


def _batch(rows, sl):
    from moeshard.data import Batch

    input_ids, labels, position_ids, document_ids = (t[sl] for t in rows)
    n = input_ids.shape[0]
    cu = torch.zeros(1, dtype=torch.int32)  # varlen segments: unused by these forwards
    return Batch(input_ids, labels, position_ids, document_ids, cu, SEQ, None, (0,) * n, (0,) * n)


def _config():
    from moeshard.models.qwen3moe import get_preset_config

    return get_preset_config("tiny", num_hidden_layers=2)


def _save(path):
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config())
    model.init_weights()
    model.save_pretrained(path)


def _reference(path, dp: int):
    """One process: the global-mean LM loss plus each data-parallel group's aux loss, averaged over the groups."""
    from moeshard.models.common import load_balancing_loss
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path)
    input_ids, labels, position_ids, document_ids = _rows(model.config.vocab_size)
    n = int((labels[:, 1:] != -100).sum())
    total = torch.zeros(())
    per = ROWS // dp
    for g in range(dp):
        sl = slice(g * per, (g + 1) * per)
        out = model(
            input_ids[sl],
            labels=labels[sl],
            position_ids=position_ids[sl],
            document_ids=document_ids[sl],
            num_items_in_batch=n,
            output_router_logits=True,
            return_logits=False,
        )
        aux = load_balancing_loss(out.router_logits, model.num_experts, model.config.num_experts_per_tok)
        total = total + out.lm_loss + AUX * aux / dp
    total.backward()
    return float(total.detach()), {name: p.grad for name, p in model.named_parameters()}


def _parallel(path, sp: int, ep: int, checkpointing: str):
    import torch.distributed as dist

    from moeshard.fsdp_moe import num_items_for_global_mean
    from moeshard.fsdp_moe.testing import full_tensors
    from moeshard.meshes import build_meshes
    from moeshard.models.common import (
        Balancing,
        BalancingOptions,
        ParallelOptions,
        load_hf_config,
        load_hf_weights,
        model_inputs,
        parallelize,
    )
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    meshes = build_meshes(ep_size=ep, device_type="cpu", sp_size=sp)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(load_hf_config(path, Qwen3MoeForCausalLM.hf_format))
    par = parallelize(model, meshes, ParallelOptions(sp_size=sp, activation_checkpointing=checkpointing))
    model.to_empty(device="cpu")
    load_hf_weights(model, path, ep_info=par.ep_info)
    balancing = Balancing(
        model, BalancingOptions(aux_loss_coef=AUX), device="cpu", sequence_group=meshes.sp.get_group()
    )
    per = ROWS // meshes.dp_size  # the data-parallel group's rows; each rank of it takes its shard
    batch = _batch(_rows(model.config.vocab_size), slice(meshes.dp_rank * per, (meshes.dp_rank + 1) * per))
    inputs = model_inputs(batch, sp_rank=meshes.sp_rank, sp_size=sp)
    balancing.start_step(1)
    out = model(
        **inputs.kwargs,
        num_items_in_batch=num_items_for_global_mean(inputs.num_targets),
        output_router_logits=True,
        return_logits=False,
    )
    term = balancing.micro_batch_loss(out, inputs.token_mask, rows=inputs.rows)
    (out.lm_loss + term).backward()
    total = (out.lm_loss + term).detach() / dist.get_world_size()
    dist.all_reduce(total)  # FSDP's mean over the ranks, as the gradients
    grads = full_tensors(model, grads=True)
    return float(total), {k: v.clone() for k, v in grads.items()}, inputs.num_targets


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp_qwen3moe")
    _save(path)
    return path


@pytest.mark.parametrize(
    ("sp", "ep", "per_node", "checkpointing"),
    [(2, 2, 2, "none"), (4, 2, 4, "full")],
    ids=["sp2xep2-two-nodes", "sp4-above-kv-heads-checkpointed"],
)
def test_sp_inside_ep_and_fsdp_equals_one_process(hf_dir, sp, ep, per_node, checkpointing):
    loss, grads = _reference(hf_dir, dp=4 // sp)
    res = run_distributed(_parallel, 4, hf_dir, sp, ep, checkpointing, ranks_per_node=per_node, timeout=300)
    _, labels, _, _ = _rows(512)
    assert sum(n for _, _, n in res) == int((labels[:, 1:] != -100).sum())  # every target counted once
    for got, got_grads, _ in res:
        assert got == pytest.approx(loss, rel=1e-5)
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_transformers_agrees_on_plain_rows(hf_dir):
    """The reference model is transformers' on rows of one document (transformers' SDPA path does not mask
    packed documents)."""
    from transformers import Qwen3MoeForCausalLM as HF

    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM

    ids = _rows(512)[0]
    ours = Qwen3MoeForCausalLM.from_pretrained(hf_dir)(ids, labels=ids, return_logits=False).lm_loss
    theirs = HF.from_pretrained(hf_dir).eval()(ids, labels=ids).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
