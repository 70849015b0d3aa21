"""The linear-attention kernels: the torch reference on packed rows (each segment computes what it computes alone),
the choice of kernels and its refusals in one line, and on CUDA with flash-linear-attention its kernels against the
reference on packed rows (forward and gradients, bf16)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from moeshard.models.common import (
    RowSegments,
    causal_conv1d_reference,
    chunk_gated_delta_rule_reference,
    linear_attention_kernels,
)
from moeshard.models.common._delta_rule import fla_platform_defect
from moeshard.models.common._sequence_layout import SequenceLayout

# 2 rows of 80: documents of 30, 3 (shorter than the convolution) and 47 (across a chunk of 64), then one of 80
DOCUMENTS = torch.tensor([[0] * 30 + [1] * 3 + [2] * 47, [5] * 80])
B, S, HK, H, DK, DV, C, K = 2, 80, 2, 4, 16, 24, 40, 4


def _inputs(device="cpu", dtype=torch.float32, seed=0):
    """``(x, weight)`` of the convolution and ``(q, k, v, g, beta)`` of the rule, leaves that require gradients."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    conv = (rand(B, S, C), rand(C, K, scale=0.5))
    g = (-torch.rand(B, S, H, generator=gen) * 0.5).to(device).requires_grad_()  # log-space decay, float32
    beta = torch.rand(B, S, H, generator=gen).to(device, dtype).requires_grad_()
    rule = (rand(B, S, HK, DK), rand(B, S, HK, DK), rand(B, S, H, DV), g, beta)
    return conv, rule


def test_cu_seqlens_start_a_segment_at_each_row_and_document():
    cu = RowSegments(document_ids_BS=DOCUMENTS).cu_seqlens(B, S, torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 30, 33, 80, 160]
    assert RowSegments().cu_seqlens(B, S, torch.device("cpu")) is None


def test_a_rank_of_a_sequence_group_reads_its_tokens_of_the_row_mask():
    mask = torch.arange(8).repeat(2, 1) % 3 != 0
    assert RowSegments(attention_mask_BS=mask).local_attention_mask(8) is mask
    second = SequenceLayout(size=2, rank=1)
    segments = RowSegments(attention_mask_BS=mask, sequence=second)
    assert segments.sequence_rank == 1
    assert torch.equal(segments.local_attention_mask(4), mask[:, 4:])
    assert torch.equal(segments.local_attention_mask(4), second.local(mask, 4))  # the decoder's own shard
    assert RowSegments(sequence=second).local_attention_mask(4) is None


def test_the_reference_on_packed_rows_equals_each_document_alone():
    (x, w), (q, k, v, g, beta) = _inputs()
    cu = RowSegments(document_ids_BS=DOCUMENTS).cu_seqlens(B, S, torch.device("cpu"))
    y = causal_conv1d_reference(x, w, DOCUMENTS)
    out = chunk_gated_delta_rule_reference(q, k, v, g, beta, cu)
    bounds = cu.tolist()
    for a, e in zip(bounds[:-1], bounds[1:]):
        r, a, e = a // S, a % S, (e - 1) % S + 1  # the segment's row and its tokens in it
        part = slice(a, e)
        torch.testing.assert_close(y[r : r + 1, part], causal_conv1d_reference(x[r : r + 1, part], w))
        alone = chunk_gated_delta_rule_reference(*(t[r : r + 1, part] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(out[r : r + 1, part], alone, rtol=1e-5, atol=1e-5)
    # the state carried on over a document boundary would give another output
    whole = chunk_gated_delta_rule_reference(q, k, v, g, beta)
    assert not torch.allclose(whole[0, 30:], out[0, 30:], atol=1e-3)


def test_kernel_choice_and_its_refusals_in_one_line(monkeypatch):
    assert linear_attention_kernels("auto", torch.device("cpu")).name == "torch"
    assert linear_attention_kernels("torch", torch.device("cuda")).name == "torch"
    with pytest.raises(ValueError, match="kernel 'triton' is not one of 'auto', 'fla', 'torch'"):
        linear_attention_kernels("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="'fla' needs a CUDA device, got cpu; use 'torch' or 'auto'"):
        linear_attention_kernels("fla", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "fla", None)  # a GPU machine without flash-linear-attention
    for kernel in ("auto", "fla"):
        with pytest.raises(ValueError) as err:
            linear_attention_kernels(kernel, torch.device("cuda"))
        line = str(err.value)
        assert "\n" not in line and err.value.__cause__ is None and err.value.__suppress_context__
        assert line.startswith("linear attention on GPU needs flash-linear-attention (")
        assert "'kernels' extra" in line and "kernel to 'torch'" in line


def test_a_platform_where_fla_backward_is_wrong_is_refused_in_one_line():
    assert fla_platform_defect((9, 0), "3.7.1", has_tilelang=False) is None
    assert fla_platform_defect((9, 0), "3.3.1", has_tilelang=False) is None
    assert fla_platform_defect((8, 0), "3.6.0", has_tilelang=False) is None  # Ampere: fla runs it
    assert fla_platform_defect((9, 0), "3.6.0", has_tilelang=True) is None  # fla's tilelang backend serves it
    line = fla_platform_defect((9, 0), "3.6.0+git1234", has_tilelang=False)
    assert "\n" not in line and "Hopper GPUs with triton 3.6.0+git1234" in line
    assert "triton>=3.7.1 or tilelang" in line and "kernel to 'torch'" in line


def _fla_skip() -> str | None:
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (the 'kernels' extra) on a CUDA GPU"
    import triton

    return fla_platform_defect(
        torch.cuda.get_device_capability(), triton.__version__, importlib.util.find_spec("tilelang") is not None
    )


@pytest.mark.skipif(_fla_skip() is not None, reason=str(_fla_skip()))
def test_flash_linear_attention_equals_the_reference_on_packed_rows():
    segments = RowSegments(document_ids_BS=DOCUMENTS.cuda())
    cuda = torch.device("cuda")
    fla, ref = linear_attention_kernels("fla", cuda), linear_attention_kernels("torch", cuda)
    assert fla.name == "fla"
    for name, segs in (("packed", segments), ("rows", RowSegments())):
        got, want = _inputs("cuda", torch.bfloat16), _inputs("cuda", torch.bfloat16)
        cu = segs.cu_seqlens(B, S, torch.device("cuda"))
        outs = []
        for kernels, ((x, w), rule) in ((fla, got), (ref, want)):
            y = kernels.conv(x, w, segs)
            o = kernels.delta_rule(*rule, cu)
            (y.float().square().sum() + (o.float() * torch.linspace(-1, 1, DV, device="cuda")).sum()).backward()
            outs.append((y, o, [t.grad for t in (x, w, *rule)]))
        (y, o, grads), (y_ref, o_ref, grads_ref) = outs
        assert o.shape == o_ref.shape == (B, S, H, DV) and y.shape == (B, S, C)
        pairs = [("conv", y, y_ref), ("rule", o, o_ref)]
        pairs += [(f"d{n}", a, b) for n, a, b in zip(("x", "w", "q", "k", "v", "g", "beta"), grads, grads_ref)]
        for what, a, b in pairs:  # bf16 in, float32 accumulation on both sides: relative error in norm
            err = float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())
            assert err < (2e-2 if what in ("conv", "rule") else 5e-2), f"{name} {what}: relative error {err:.2e}"
