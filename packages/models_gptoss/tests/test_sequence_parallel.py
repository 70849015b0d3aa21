"""GPT-OSS under sequence parallelism: 2 gloo ranks share each packed row (sp 2); each attends with its half of the
query heads and their sinks over the whole row (sliding windows of 8 keys in rows of 16 tokens, documents across
the shards' boundary). The summed shard losses and the summed gradients (the sinks' included) equal one process's on
the whole rows."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from moeshard.meshes.testing import run_distributed
from moeshard.models.common import IGNORE_INDEX, apply_sequence_parallel
from moeshard.models.gptoss import GptOssForCausalLM, get_preset_config
from moeshard.sequence import shard_row


def _packed_rows(vocab: int):
    """Two rows of 16 tokens cut into documents (positions restart; a piece's first token is no target); a document
    crosses the middle of each row, where the shards meet, and is longer than the window."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab, (2, 16), generator=gen)
    starts = [[0, 2, 15], [0, 3, 5]]
    document_ids = torch.zeros(2, 16, dtype=torch.int32)
    position_ids = torch.zeros(2, 16, dtype=torch.int64)
    labels = input_ids.clone()
    for b, row in enumerate(starts):
        for d, (start, stop) in enumerate(zip(row, row[1:] + [16])):
            document_ids[b, start:stop] = d
            position_ids[b, start:stop] = torch.arange(stop - start)
            labels[b, start] = IGNORE_INDEX
    return input_ids, labels, position_ids, document_ids


def _model(**overrides) -> GptOssForCausalLM:
    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset_config("tiny", num_hidden_layers=2, **overrides))
    model.init_weights()
    with torch.no_grad():  # sinks of different sizes per head, so that a rank taking another's would show
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.num_heads))
    return model


def _sp_equals_whole_rows(overrides: dict):
    model = _model(**overrides)
    input_ids, labels, position_ids, document_ids = _packed_rows(model.config.vocab_size)
    num_targets = int((labels[:, 1:] != IGNORE_INDEX).sum())

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
        num_items_in_batch=num_targets,  # every shard's targets: the loss is the mean over the whole rows
        return_logits=False,
    ).lm_loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each rank's tokens' part (its heads' part, for the sinks)
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    sinks = model.model.layers[0].self_attn.sinks.grad
    return sp, shard.num_targets, bool(sinks[:2].any()), bool(sinks[2:].any())


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-2", "sp-above-kv-heads"])
def test_sp2_loss_and_gradients_equal_the_whole_rows(kv_heads):
    res = run_distributed(_sp_equals_whole_rows, 2, {"num_key_value_heads": kv_heads})
    assert [sp for sp, *_ in res] == [2, 2]
    _, labels, _, _ = _packed_rows(512)
    assert sum(n for _, n, _, _ in res) == int((labels[:, 1:] != IGNORE_INDEX).sum())  # every target counted once
    # rank 0 attends with heads 0-1 and reaches their sinks alone, rank 1 with heads 2-3
    assert [(first, second) for _, _, first, second in res] == [(True, False), (False, True)]


def test_attention_call_takes_only_a_head_shard_wrapper():
    attention = _model().model.layers[0].self_attn
    assert attention.attention_call is None
    with pytest.raises(ValueError, match="head-shard wrapper with attn_fn and group") as info:
        attention.attention_call = lambda q, k, v, *a, **kw: q
    assert "\n" not in str(info.value)
