"""GPT-OSS's attention on CUDA through flex attention (sinks by the log-sum-exp, windows and documents in the
``BlockMask``): equal to the dense reference in forward and gradients within bf16 tolerance, eager and compiled; the
compiled call holds no ``S x S`` tensor."""

import pytest
import torch

from moeshard.models.gptoss import sink_attention, sliding_masks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's fused kernel needs CUDA")

B, H, G, DH = 2, 8, 2, 64


def _inputs(s: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, n, s, DH, device="cuda", generator=gen) for n in (H, G, G))
    sinks = torch.randn(H, device="cuda", generator=gen)
    return q, k, v, sinks


def _documents(s: int) -> torch.Tensor:
    cuts = torch.tensor([[s // 3, s // 2], [s // 5, 4 * s // 5]], device="cuda")  # three documents a row
    pos = torch.arange(s, device="cuda")
    return (pos[None, :, None] >= cuts[:, None, :]).sum(-1)


def _run(fn, mask, q, k, v, sinks, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)] + [sinks.detach().requires_grad_()]
    out = fn(*leaves[:3], mask, leaves[3], DH**-0.5)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
    return [out.float()] + [t.grad.float() for t in leaves]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layer", ["sliding_attention", "full_attention"])
def test_flex_sinks_windows_documents_equal_the_dense_reference(layer, compiled):
    s, window = 512, 128
    q, k, v, sinks = _inputs(s)
    docs = _documents(s)
    # the dense reference (float32): boolean document-causal masks with the window
    same = (docs[:, :, None] == docs[:, None, :]) & torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    dense = sliding_masks(same[:, None], window, docs, s, q.device)[layer]  # a boolean base: the dense rule
    want = _run(sink_attention, dense, q, k, v, sinks, torch.float32)
    base = sliding_masks(None, window, docs, s, q.device)["full_attention"]  # a BlockMask on CUDA
    flex = sliding_masks(base, window, docs, s, q.device)[layer]
    fn = torch.compile(sink_attention, fullgraph=True) if compiled else sink_attention
    got = _run(fn, flex, q, k, v, sinks, torch.bfloat16)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=lambda m, n=name: f"{layer} {n}: {m}")
    assert want[-1].abs().sum() > 0


def test_compiled_flex_holds_no_s_by_s_tensor():
    s, window = 16384, 128
    q, k, v, sinks = (t.to(torch.bfloat16) if t.dim() > 1 else t for t in _inputs(s, seed=1))
    masks = sliding_masks(None, window, None, s, q.device)
    fn = torch.compile(sink_attention, fullgraph=True)
    fn(q, k, v, masks["sliding_attention"], sinks, DH**-0.5)  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(q, k, v, masks["sliding_attention"], sinks, DH**-0.5)
    torch.cuda.synchronize()
    one_head_scores = s * s * 2  # bf16 bytes of one head's S x S scores
    assert torch.cuda.max_memory_allocated() - before < one_head_scores, "flex materialised S x S scores"
    assert torch.isfinite(out).all()
