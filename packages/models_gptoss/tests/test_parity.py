"""Equal to transformers' ``GptOssForCausalLM`` in float32 on CPU: logits, loss and every gradient, rows longer than
the sliding window, non-zero sinks and biases, both layer types; packed documents equal each document alone; the
flex (BlockMask) path equal to the dense one; MXFP4 dequantised as transformers does it."""

import pytest
import torch
from transformers import GptOssForCausalLM as HFGptOss

from moeshard.models.gptoss import GptOssForCausalLM, get_preset_config
from moeshard.models.gptoss._checkpoint import dequantize_mxfp4, experts_from_hub, experts_to_hub

_EXPERT = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _pair(seed=0):
    torch.manual_seed(seed)
    config = get_preset_config("tiny")
    config._attn_implementation = "eager"
    hf = HFGptOss(config).float()
    with torch.no_grad():  # every parameter random: sinks and biases non-zero
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ours = GptOssForCausalLM(get_preset_config("tiny"))
    state = {}
    for k, v in hf.state_dict().items():
        name = k.rsplit(".", 1)[-1]
        state[k] = experts_from_hub(name, v) if ".mlp.experts." in k and name in _EXPERT else v
    ours.load_state_dict(state, strict=True)
    return hf, ours


def _grads(model, to_hf=False):
    out = {}
    for k, p in model.named_parameters():
        g = p.grad
        name = k.rsplit(".", 1)[-1]
        if to_hf and ".mlp.experts." in k and name in _EXPERT:
            g = experts_to_hub(name, g)
        out[k] = g
    return out


def test_logits_loss_and_every_gradient_equal_transformers():
    hf, ours = _pair()
    ids = torch.randint(0, 512, (2, 24))  # 24 > window 8
    a = hf(input_ids=ids, labels=ids)
    b = ours(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    ga, gb = _grads(hf), _grads(ours, to_hf=True)
    assert ga.keys() == gb.keys()
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=1e-4, atol=1e-5, msg=k)
    assert ours.model.layers[0].self_attn.sinks.grad.abs().sum() > 0


def test_packed_documents_equal_each_document_alone():
    hf, ours = _pair(seed=1)
    lengths = (13, 3, 12)
    docs = [torch.randint(0, 512, (1, n)) for n in lengths]
    ids = torch.cat(docs, dim=1)
    doc_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = ours(ids, position_ids=pos, document_ids=doc_ids).logits
    alone = torch.cat([hf(input_ids=d).logits for d in docs], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_flex_block_masks_equal_the_dense_masks():
    _, ours = _pair(seed=2)
    ids = torch.randint(0, 512, (2, 20))
    doc_ids = torch.tensor([[0] * 12 + [1] * 8, [0] * 5 + [1] * 15])
    with torch.no_grad():
        dense = ours(ids, document_ids=doc_ids).logits
        ours.model.document_attention = "flex"
        flex = ours(ids, document_ids=doc_ids).logits
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_mxfp4_dequantised_exactly_as_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (2, 6, 2), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (2, 6, 64)  # [E, out, in]: our rows; transformers returns them turned, [E, in, out]
    assert torch.equal(got.transpose(1, 2), want)
    with pytest.raises(ValueError, match="MXFP4 needs uint8 blocks"):
        dequantize_mxfp4(blocks.float(), scales)
