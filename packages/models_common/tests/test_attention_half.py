"""The decoder layer is plain PyTorch: forward = attention_half then the MLP, and what ``parallelize`` and
``apply_activation_checkpointing`` change (a layer's attention half and checkpoint, the head's ``chunk_loss``) are
values the modules declare (``execution``, ``options``), replaced whole."""

import dataclasses

import pytest
import torch

from moeshard.models.common import MoEBlock, ce_chunk
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM


def _model() -> ToyForCausalLM:
    model = ToyForCausalLM(ToyConfig(num_hidden_layers=2, dense_layers=[1]))
    model.init_weights(torch.Generator().manual_seed(1))
    return model


@pytest.mark.parametrize("padded", [False, True])
def test_attention_half_then_mlp_is_the_layer(padded):
    from moeshard.models.common._layers import build_attention_mask

    torch.manual_seed(0)
    model = _model()
    b, s = 2, 12
    x_BSD = torch.randn(b, s, model.config.hidden_size)
    mask_BS = torch.ones(b, s, dtype=torch.long)
    if padded:
        mask_BS[1, :3] = 0
    mask = build_attention_mask(mask_BS, s)
    cos, sin = model.model.rotary_emb(torch.arange(s)[None], x_BSD.dtype)
    for layer in model.model.layers:
        x_half, h_half, routing = layer.attention_half(x_BSD, cos, sin, mask)
        x_ref = x_BSD + layer.self_attn(layer.input_layernorm(x_BSD), cos, sin, mask)
        assert torch.equal(x_half, x_ref)
        assert torch.equal(h_half, layer.post_attention_layernorm(x_ref))
        out, routed = layer(x_BSD, cos, sin, mask)
        if isinstance(layer.mlp, MoEBlock):
            # the router runs in the attention half (compiled with it); the block routes alike without it
            for got, want in zip(routing, layer.mlp.gate(h_half.reshape(b * s, -1)), strict=True):
                assert torch.equal(got, want)
            y, ref_logits = layer.mlp(h_half)
            assert torch.equal(routed[0], ref_logits) and torch.equal(layer.mlp(h_half, routing)[0], y)
            assert torch.equal(routed[1], routing[2])  # the layer hands on the selection it routed by
        else:
            y = layer.mlp(h_half)
            assert routed is None and routing is None
        assert torch.equal(out, x_half + y)


def test_declared_values_replace_the_compiled_parts_and_keep_fqns():
    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref = model(ids, labels=ids, return_logits=False).loss
    keys = list(model.state_dict())
    calls = {"attention_half": 0, "checkpoint": 0, "chunk_loss": 0}

    def counting(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    for layer in model.model.layers:
        layer.execution = dataclasses.replace(
            layer.execution,
            attention_half=counting("attention_half", layer.attention_half),
            checkpoint=counting("checkpoint", lambda forward, *args: forward(*args)),
        )
    head = model.lm_head
    head.options = dataclasses.replace(head.options, chunk_loss=counting("chunk_loss", head.options.chunk_loss))
    assert type(head).options.chunk_loss is ce_chunk  # the class default is untouched
    loss = model(ids, labels=ids, return_logits=False).loss
    assert calls == {"attention_half": 2, "checkpoint": 2, "chunk_loss": 1}
    assert torch.equal(loss, ref)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == keys
    assert not any({"forward", "attention_half", "chunk_loss"} & vars(m).keys() for m in model.modules())
