"""The attention a checkpointed region keeps: SDPA's bits, and a recompute that replays instead of computing."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import moeshard.models.common._kept as kept
from moeshard.models.common import AttentionOptions, ParallelOptions, attend
from moeshard.models.common._fa4 import fa4_unavailable
from moeshard.models.common._kept import (
    KEPT_ATTENTION,
    AttentionKeep,
    kept_attention_applies,
    kept_attention_device,
    kept_causal_attention,
    kept_linear,
    kept_topk,
)
from moeshard.models.common.testing import reference_fa4

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _qkv(device: str, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, s: int = 16, d: int = 8):
    g = torch.Generator().manual_seed(0)
    # q, k, v as the families make them: [B, S, H, D] projections seen as [B, H, S, D]
    q, k, v = (torch.randn(2, s, h, d, generator=g).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    return tuple(t.transpose(1, 2).requires_grad_() for t in (q, k, v))


def _region(q, k, v, w, options=KEPT_ATTENTION):
    # a region that saves things around the kept operations, as a decoder layer does: the attention, its output
    # projection (the heads flattened), a top-k of its output's scores
    out = attend(q * 1.5, k, v, None, scale=0.3, enable_gqa=q.shape[1] != k.shape[1], options=options)
    b, h, s, d = out.shape
    y = kept_linear(out.transpose(1, 2).reshape(b, s, h * d), w)
    values, ids = kept_topk(y.float().softmax(-1), 2)
    return y.sin() + (values * ids).sum(-1, keepdim=True).to(y.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_same_bits_as_sdpa(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    d = 8 if device == "cpu" else 128
    q, k, v = _qkv(device, dtype, d=d, s=64)
    assert kept_attention_applies(q, k, v, 0.0) and kept_attention_device(q.device)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    out = kept_causal_attention(q, k, v, 0.3)
    assert out.shape == ref.shape and out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_recompute_replays_the_forward_attention(device, compiled, monkeypatch):
    """Under checkpoint, the kernel runs in the forward only; the recompute hands back what it kept (and lets go
    of it); the gradients are those of the region run without checkpointing, and of a plain checkpoint."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = _qkv(device, dtype, d=8 if device == "cpu" else 64)
    w = torch.randn(6, q.shape[1] * q.shape[-1], device=device, dtype=dtype, requires_grad=True)
    # fullgraph: the kept operations trace without a graph break (a break costs a layout copy of q, k, v and the
    # output's gradient on each side of it)
    region = torch.compile(_region, fullgraph=True) if compiled else _region
    grad = torch.randn_like(_region(q, k, v, w))
    ref = region(q, k, v, w)
    ref_grads = torch.autograd.grad(ref, (q, k, v, w), grad)

    runs, compute = [], kept._compute
    monkeypatch.setattr(kept, "_compute", lambda *a: runs.append(1) or compute(*a))
    keep = AttentionKeep()
    out = checkpoint(region, q, k, v, w, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying()))
    assert len(runs) == 1 and len(keep) == 3  # the attention, the projection, the top-k
    grads = torch.autograd.grad(out, (q, k, v, w), grad)
    assert len(runs) == 1 and len(keep) == 0  # replayed, not run; nothing held after the recompute
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    none = contextlib.nullcontext
    out = checkpoint(region, q, k, v, w, use_reentrant=False, context_fn=lambda: (none(), none()))
    for got, want in zip(torch.autograd.grad(out, (q, k, v, w), grad), ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(runs) == 3  # a plain checkpoint runs the kernel again in its recompute


@pytest.mark.parametrize("device", DEVICES)
def test_kept_linear_and_topk_are_linear_and_topk(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 16, generator=g).to(device).requires_grad_()
    w = torch.randn(8, 16, generator=g).to(device).requires_grad_()
    grad = torch.randn(2, 5, 8, generator=g).to(device)
    got = torch.autograd.grad(kept_linear(x, w), (x, w), grad)
    for a, b in zip(got, torch.autograd.grad(F.linear(x, w), (x, w), grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    scores = torch.randn(7, 12, generator=g).to(device).softmax(-1).requires_grad_()
    values, ids = kept_topk(scores, 3)
    ref_values, ref_ids = torch.topk(scores, 3, dim=-1)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    grad_v = torch.randn(7, 3, generator=g).to(device)
    got, want = torch.autograd.grad(values, scores, grad_v)[0], torch.autograd.grad(ref_values, scores, grad_v)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_recompute_that_differs_from_its_forward_is_refused():
    q, k, v = _qkv("cpu", torch.float32)
    keep = AttentionKeep()
    with keep.recording():
        kept_causal_attention(q, k, v, 0.3)
    with keep.replaying(), pytest.raises(RuntimeError, match="is not the one its forward kept"):
        kept_causal_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], 0.3)
    with keep.replaying():  # each replay starts from the first kept outputs
        kept_causal_attention(q, k, v, 0.3)
        with pytest.raises(RuntimeError, match="more kept operations than its forward kept"):
            kept_causal_attention(q, k, v, 0.3)


def test_where_the_kept_kernels_do_not_apply_attend_is_sdpa():
    q, k, v = _qkv("cpu", torch.float32)
    assert not kept_attention_applies(q, k, v, 0.1)  # dropout
    assert not kept_attention_device("meta")
    q12 = torch.randn(2, 4, 16, 12)
    assert not kept_attention_applies(q12, q12[:, :2], v, 0.0)  # MLA: query and value head sizes differ
    keep = AttentionKeep()
    with keep.recording():
        out = attend(q12, q12[:, :2], v, None, scale=0.3, enable_gqa=True, options=KEPT_ATTENTION)
    assert len(keep) == 0
    ref = F.scaled_dot_product_attention(q12, q12[:, :2], v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_compiled_code_reusing_an_unread_output_buffer_does_not_change_the_replay():
    """Backward does not read the projection's output: compiled code may write the residual into its buffer once
    the add has read it. The keep holds a copy, so the recompute replays the forward's value (the gradient of
    ``h * h`` reads the recomputed ``h``)."""

    def region(x, w, r):
        h = kept_linear(x, w) + r
        return h * h

    g = torch.Generator().manual_seed(2)
    x, w, r = (torch.randn(*s, generator=g).requires_grad_() for s in ((4, 64, 32), (32, 32), (4, 64, 32)))
    compiled = torch.compile(region, fullgraph=True)
    grad = torch.randn(4, 64, 32, generator=g)
    want = torch.autograd.grad(region(x, w, r), (x, w, r), grad)
    keep = AttentionKeep()
    out = checkpoint(compiled, x, w, r, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying()))
    for got, ref in zip(torch.autograd.grad(out, (x, w, r), grad), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_fa4_layouts_keep_and_gradients(monkeypatch):
    """FlashAttention 4's path (its entry points computed on CPU by ``reference_fa4``): the [B, S, heads, D] views
    it is given and the output it returns give SDPA's attention and gradients; under a keeping checkpoint it runs
    once forward and once backward, and the recompute replays it."""
    calls = reference_fa4(monkeypatch)
    q, k, v = _qkv("cpu", torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    grad = torch.randn_like(ref)
    out = kept_causal_attention(q, k, v, 0.3, "fa4")
    assert out.shape == ref.shape and dict(calls) == {"forward": 1}
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    w = torch.randn(6, q.shape[1] * q.shape[-1], requires_grad=True)
    grad = torch.randn_like(_region(q, k, v, w))
    want = torch.autograd.grad(_region(q, k, v, w), (q, k, v, w), grad)
    calls.clear()
    keep = AttentionKeep()
    mask = AttentionOptions(kernel="fa4", keep=True)
    out = checkpoint(
        _region, q, k, v, w, mask, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying())
    )
    assert dict(calls) == {"forward": 1} and len(keep) == 3
    for got, ref_grad in zip(torch.autograd.grad(out, (q, k, v, w), grad), want):
        torch.testing.assert_close(got, ref_grad, rtol=1e-5, atol=1e-6)
    assert dict(calls) == {"forward": 1, "backward": 1} and len(keep) == 0


def test_fa4_refused_where_it_cannot_run():
    assert "CUDA devices only" in fa4_unavailable("cpu")
    with pytest.raises(ValueError, match="attention_kernel='flash' is not one of"):
        ParallelOptions(attention_kernel="flash")
    with pytest.raises(ValueError, match="must be one of"):
        AttentionOptions(kernel="flash")
    q12 = torch.randn(2, 4, 16, 12)
    assert not kept_attention_applies(q12, q12, q12, 0.0, "fa4")  # CPU: attend falls back to SDPA


@pytest.mark.skipif(
    not torch.cuda.is_available() or fa4_unavailable("cuda") is not None,
    reason="FlashAttention 4 (flash-attn-4) on a Hopper or Blackwell GPU",
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fa4_kernels_close_to_sdpa_on_cuda(compiled):
    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    q, k, v = _qkv("cuda", torch.bfloat16, heads=8, kv_heads=2, s=512, d=128)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    attention = torch.compile(kept_causal_attention, fullgraph=True) if compiled else kept_causal_attention
    out = attention(q, k, v, 0.3, "fa4")
    assert out.shape == ref.shape and rel(out, ref) < 1e-2  # cuDNN against FA2: ~2e-3 (measured on a GPU)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
        assert rel(got, want) < 1e-2
    w = torch.randn(64, q.shape[1] * q.shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    region = torch.compile(_region, fullgraph=True) if compiled else _region
    mask = AttentionOptions(kernel="fa4", keep=True)
    ones = torch.ones(2, 512, 64, device="cuda", dtype=torch.bfloat16)
    want = torch.autograd.grad(region(q, k, v, w, mask), (q, k, v, w), ones)
    keep = AttentionKeep()
    out = checkpoint(
        region, q, k, v, w, mask, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying())
    )
    for got, ref_grad in zip(torch.autograd.grad(out, (q, k, v, w), ones), want):
        assert rel(got, ref_grad) < 1e-3  # replayed: the same kernels' outputs (dq by atomics: not bitwise)


def test_attention_options_are_values_apart_from_the_mask():
    """The kernel and the keep are options, resolved per device into one object per value (a compiled caller sees
    the same constant every step); the mask stays None for plain causal rows, and ``attend`` with the default
    options is SDPA's causal attention, bit for bit."""
    assert AttentionOptions(keep=True).on("cpu") is KEPT_ATTENTION  # the CPU has the kept kernels
    assert AttentionOptions(keep=True).on("meta") is AttentionOptions().on("cpu")  # no kept kernels: not kept
    assert AttentionOptions(kernel="fa4").runs_kept and KEPT_ATTENTION.runs_kept and not AttentionOptions().runs_kept
    q, k, v = _qkv("cpu", torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    keep = AttentionKeep()
    with keep.recording():
        plain = attend(q, k, v, None, scale=0.3, enable_gqa=True, options=AttentionOptions())
        kept_out = attend(q, k, v, None, scale=0.3, enable_gqa=True, options=KEPT_ATTENTION)
    assert len(keep) == 1  # only the kept one went through kept_causal_attention
    torch.testing.assert_close(plain, ref, rtol=0, atol=0)
    torch.testing.assert_close(kept_out, ref, rtol=0, atol=0)


def test_a_kept_output_projection_with_hooks_is_called_not_replayed():
    """``attention_output`` under the keeping options runs a plain linear as ``kept_linear`` (its GEMM only), which
    would drop what a hook adds (a LoRA adapter on ``o_proj`` is a forward hook): such a module is called instead,
    in the checkpointed forward and in its recompute, and its output and gradients are those without keeping."""
    from moeshard.models.common import attention_output

    torch.manual_seed(0)
    o_proj = torch.nn.Linear(8, 6, bias=False)
    extra = torch.nn.Parameter(torch.randn(6))
    o_proj.register_forward_hook(lambda module, args, out: out + extra)
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = o_proj(x)
    keep = kept.AttentionKeep()

    def region(x):
        return attention_output(o_proj, x, None, kept.KEPT_ATTENTION)

    got = checkpoint(region, x, use_reentrant=False, context_fn=lambda: (keep.recording(), keep.replaying()))
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    grads = torch.autograd.grad(got, (x, o_proj.weight, extra), g)
    wants = torch.autograd.grad(want, (x, o_proj.weight, extra), g)
    for a, b in zip(grads, wants):
        torch.testing.assert_close(a, b)
    hookless = torch.nn.Linear(8, 6, bias=False)  # the same call on a module without hooks keeps its output
    keep2 = kept.AttentionKeep()
    with keep2.recording():
        attention_output(hookless, x, None, kept.KEPT_ATTENTION)
    assert len(keep2) == 1 and len(keep) == 0
