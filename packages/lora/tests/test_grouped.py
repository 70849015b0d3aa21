"""expert_lora_delta: both backends equal a per-expert reference, forward and backward, empty experts included."""

import pytest
import torch

from moeshard.lora import expert_lora_delta
from moeshard.lora._grouped import resolve_lora_gemm


def _reference(x, counts, A, B, s):
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start : start + n] @ A[e].T @ B[e].T * s)
        start += n
    return torch.cat(out)


def _inputs(dtype, counts=(3, 0, 5, 1), r=4, k=8, m=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    x = torch.randn(N, k, generator=g).to(dtype).requires_grad_()
    A = torch.randn(E, r, k, generator=g).requires_grad_()  # float32 masters
    B = torch.randn(E, m, r, generator=g).requires_grad_()
    return x, list(counts), A, B


@pytest.mark.parametrize("gemm", ["grouped_mm", "masked"])
def test_backends_equal_the_per_expert_reference(gemm):
    x, counts, A, B = _inputs(torch.float32)
    y = expert_lora_delta(x, torch.tensor(counts), A, B, 0.5, gemm=gemm)
    w = torch.randn_like(y)
    (y * w).sum().backward()  # a non-contiguous-free but non-trivial upstream gradient
    got = [t.grad.clone() for t in (x, A, B)]
    for t in (x, A, B):
        t.grad = None
    ref = _reference(x, counts, A, B, 0.5)
    (ref * w).sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, (x.grad, A.grad, B.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert A.grad[1].abs().sum() == 0 and B.grad[1].abs().sum() == 0  # the expert without rows: zeros
    assert A.grad.dtype == torch.float32  # the master gets its gradient in its own dtype


def test_sum_backward_and_bf16_rows():
    # a sum's gradient is expanded (stride 0): torch's own grouped_mm backward refuses it, ours copes
    x, counts, A, B = _inputs(torch.bfloat16, r=8, k=16, m=8)
    assert resolve_lora_gemm("auto", x, 8, 8) == "grouped_mm"
    y = expert_lora_delta(x, counts, A, B, 2.0)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    ref = _reference(x.detach().float(), counts, A.detach(), B.detach(), 2.0)
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)
    assert A.grad.shape == A.shape and B.grad.dtype == torch.float32


def test_auto_falls_back_to_masked_where_grouped_mm_cannot_run():
    x, counts, A, B = _inputs(torch.float64, r=3, k=5, m=7)
    assert resolve_lora_gemm("auto", x, 3, 7) == "masked"
    x32 = x.detach().float()
    assert resolve_lora_gemm("auto", x32, 3, 7) == "masked"  # 3 float32 = 12 bytes: unaligned
    y = expert_lora_delta(x, counts, A, B, 1.0)
    torch.testing.assert_close(y, _reference(x, counts, A.double(), B.double(), 1.0))


def test_bad_shapes_are_one_line_errors():
    x, counts, A, B = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"lora_A \[E, r, K\] and lora_B \[E, M, r\]"):
        expert_lora_delta(x, counts, A, B.transpose(1, 2), 1.0)
    with pytest.raises(ValueError, match="summing to the 9 rows"):
        expert_lora_delta(x, [1, 1, 1, 1], A, B, 1.0)
    with pytest.raises(ValueError, match="gemm='loop' is not one of"):
        expert_lora_delta(x, counts, A, B, 1.0, gemm="loop")
