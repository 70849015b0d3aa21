"""Sequence parallelism on the real families: 2 gloo ranks share each packed row (sp 2); the summed shard losses
and the summed gradients equal one process's on the whole rows (Qwen3-MoE with 2 and with 1 KV heads, the
DeepSeek-V3 architecture's MLA, Qwen3.5-MoE's Gated DeltaNet beside its gated attention: the DeltaNet's convolution
and state run along the whole row on head shards)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from moeshard.meshes.testing import run_distributed
from moeshard.models.common import IGNORE_INDEX, apply_sequence_parallel
from moeshard.sequence import shard_row

X = IGNORE_INDEX


def _packed_rows(vocab: int):
    """Two rows of 16 tokens, cut into documents (positions restart, a piece's first token is no target); a
    document crosses the middle of each row, where the shards meet."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab, (2, 16), generator=gen)
    starts = [[0, 5, 13], [0, 2, 3, 11]]
    document_ids = torch.zeros(2, 16, dtype=torch.int32)
    position_ids = torch.zeros(2, 16, dtype=torch.int64)
    labels = input_ids.clone()
    for b, row in enumerate(starts):
        for d, (start, stop) in enumerate(zip(row, row[1:] + [16])):
            document_ids[b, start:stop] = d
            position_ids[b, start:stop] = torch.arange(stop - start)
            labels[b, start] = X
    return input_ids, labels, position_ids, document_ids


def _model(family: str, **overrides):
    if family == "qwen3moe":
        from moeshard.models.qwen3moe import Qwen3MoeForCausalLM as cls
        from moeshard.models.qwen3moe import get_preset_config
    elif family == "qwen35moe":
        from moeshard.models.qwen35moe import Qwen35MoeForCausalLM as cls
        from moeshard.models.qwen35moe import get_preset_config
    else:
        from moeshard.models.deepseekv3 import DeepseekV3ForCausalLM as cls
        from moeshard.models.deepseekv3 import get_preset_config
    torch.manual_seed(0)
    model = cls(get_preset_config("tiny", num_hidden_layers=2, **overrides))
    model.init_weights()
    return model


def _sp_equals_whole_rows(family: str, overrides: dict):
    model = _model(family, **overrides)
    input_ids, labels, position_ids, document_ids = _packed_rows(model.config.vocab_size)
    num_targets = int((labels != X).sum())

    reference = copy.deepcopy(model)
    ref = reference(
        input_ids,
        labels=labels,
        position_ids=position_ids,
        document_ids=document_ids,
        num_items_in_batch=num_targets,
        return_logits=False,
    ).lm_loss
    ref.backward()

    sp = apply_sequence_parallel(model, dist.group.WORLD)
    shard = shard_row(
        input_ids, labels, sp_rank=dist.get_rank(), sp_size=sp, position_ids=position_ids, document_ids=document_ids
    )
    loss = model(
        shard.input_ids,
        shift_labels=shard.targets,
        position_ids=shard.position_ids,
        document_ids=shard.row_document_ids,
        num_items_in_batch=num_targets,  # the targets of every shard: the loss is the mean over the whole rows
        return_logits=False,
    ).lm_loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-6)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's tokens' part of the gradient (data parallel over shards sums them)
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, float((grad - q.grad).abs().max()))
    return sp, shard.num_targets, worst


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3moe", {}),
        ("qwen3moe", {"num_key_value_heads": 1}),
        ("deepseekv3", {}),
        ("qwen35moe", {"layer_types": ["linear_attention", "full_attention"]}),
    ],
    ids=["qwen3moe", "qwen3moe-sp-above-kv-heads", "deepseekv3-mla", "qwen35moe-deltanet"],
)
def test_sp2_loss_and_gradients_equal_the_whole_rows(family, overrides):
    res = run_distributed(_sp_equals_whole_rows, 2, family, overrides)
    assert [sp for sp, _, _ in res] == [2, 2]
    input_ids, labels, *_ = _packed_rows(512)
    assert sum(n for _, n, _ in res) == int((labels != X).sum())  # every target counted once


def test_a_shard_cannot_shift_its_own_labels():
    model = _model("qwen3moe")
    ids = torch.randint(0, 512, (1, 8))
    with pytest.raises(ValueError, match="not both"):
        model(ids, labels=ids, shift_labels=ids)
    model.model.sequence = dataclasses.replace(model.model.sequence, size=2)  # as apply_sequence_parallel leaves it
    with pytest.raises(ValueError, match="pass shift_labels"):
        model(ids, labels=ids, position_ids=torch.arange(8))
    with pytest.raises(ValueError, match="whole-row position_ids"):
        model(ids, shift_labels=ids)


def test_a_deltanet_whose_heads_do_not_split_is_refused_in_one_line():
    from moeshard.meshes import fake_process_group

    model = _model("qwen35moe", layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1)
    with fake_process_group(2):
        with pytest.raises(ValueError) as err:
            apply_sequence_parallel(model, dist.group.WORLD)
    assert str(err.value) == (
        "sequence parallelism sp=2 splits GatedDeltaNet's heads over ranks: its 4 value heads and 1 key heads must "
        "both divide by sp; use an sp that divides both"
    )
