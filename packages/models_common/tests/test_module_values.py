"""What ``parallelize`` and the ``apply_*`` functions change on a model are values its modules declare and read
(a layer's ``execution``, a router's ``selection``, the decoder's ``sequence``, the head's and the embedding's
``options``), each replaced whole: nothing else is written on an instance."""

import dataclasses

import pytest
import torch

from moeshard.models.common import TopKRouter, apply_activation_checkpointing
from moeshard.models.common._causal_lm import LayerExecution, SequenceLayout
from moeshard.models.common._moe import TopkSelection
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM


def _model() -> ToyForCausalLM:
    torch.manual_seed(0)
    model = ToyForCausalLM(ToyConfig(num_hidden_layers=2, dense_layers=[1]))
    model.init_weights(torch.Generator().manual_seed(1))
    return model


def _instance_attributes(model: torch.nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(m)) for name, m in model.named_modules()}


def test_selection_is_one_object_per_value():
    default = TopKRouter(8, 4, 2, True).selection
    assert default == TopkSelection() and default.replace() is default
    kept = default.replace(kept=True)
    assert kept.kept and kept.kernel is None and kept is default.replace(kept=True)
    assert kept.replace(kept=False) is default
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.kept = False


@pytest.mark.parametrize("keep", [True, False])
def test_checkpointing_replaces_the_layers_and_routers_values_only(keep):
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref = model(ids, labels=ids, return_logits=False).loss
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    before = _instance_attributes(model)

    apply_activation_checkpointing(model, keep_attention=keep)
    after = _instance_attributes(model)
    # Only the declared values appear, nothing else (no patched forward).
    assert {n: after[n] - before[n] for n in after if after[n] != before[n]} == {
        **{f"model.layers.{i}": {"execution"} for i in range(2)},
        "model.layers.0.mlp.gate": {"selection"},  # the MoE layer's router; layer 1 is dense
    }
    for layer in model.model.layers:
        assert layer.execution.checkpoint is not None and layer.execution.attention_half is None
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.selection is TopkSelection().replace(kept=keep) for r in routers)
    assert type(routers[0]).selection.kept is False  # the class default is untouched
    assert model.model.attention.keep is keep

    loss = model(ids, labels=ids, return_logits=False).loss
    loss.backward()
    assert torch.equal(loss, ref)  # the same bits, recomputed
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    with pytest.raises(ValueError, match="apply it once"):
        apply_activation_checkpointing(model)


def test_layer_execution_defaults_run_the_layer_plainly():
    model = _model()
    assert all(layer.execution == LayerExecution() for layer in model.model.layers)
    assert model.model.sequence == SequenceLayout(size=1, rank=0)


def test_sequence_layout_names_its_shard():
    whole = torch.arange(12).reshape(2, 6)
    assert torch.equal(SequenceLayout(size=3, rank=1).local(whole, 2), whole[:, 2:4])
    assert torch.equal(SequenceLayout().local(whole, 6), whole)
    for size, rank in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError, match=f"size={size}, rank={rank}"):
            SequenceLayout(size=size, rank=rank)
