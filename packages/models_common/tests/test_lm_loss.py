"""The chunked LM-head cross-entropy equals the plain path (loss and both gradients)."""

import pytest
import torch
import torch.nn.functional as F

from moeshard.models.common import linear_cross_entropy


@pytest.mark.parametrize("chunk", [3, 7, 64])
@pytest.mark.parametrize("num_items", [None, 9.0])
def test_matches_plain_cross_entropy(chunk, num_items):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 16, generator=g, dtype=torch.float32, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float32, requires_grad=True)
    t = torch.randint(0, 50, (20,), generator=g)
    t[[2, 5, 19]] = -100
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100, reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        ref = ref / num_items
    (ref * 1.7).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out = linear_cross_entropy(h, w, t, num_items, chunk_size=chunk)
    (out * 1.7).backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, gw, rtol=1e-5, atol=1e-6)


def test_all_ignored_is_zero_not_nan():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    out = linear_cross_entropy(h, w, torch.full((4,), -100))
    out.backward()
    assert out.item() == 0.0 and torch.all(h.grad == 0) and torch.all(w.grad == 0)


def test_backward_scaling_per_dtype():
    # The head's backward scales its saved gradients by the incoming one: one pass per dtype, None passed through,
    # the factor taken in each gradient's dtype (what lets the device's _foreach_mul vectorise).
    from moeshard.models.common._lm_loss import _scaled

    g16, g32 = torch.randn(5, 3).bfloat16(), torch.randn(4)
    factor = torch.tensor(1 / 3)
    a, none, b = _scaled(g16, None, g32, factor=factor)
    assert none is None and a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(a, g16 * factor.bfloat16()) and torch.equal(b, g32 * factor)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]
)
def test_head_weight_gradient_in_bf16_is_the_float32_sum_of_chunks(device):
    # The [V, D] float32 accumulator is written by the first chunk's GEMM and added to by the others' (on CUDA in
    # the GEMM's epilogue, mm/addmm with out_dtype=float32): it equals the float32 sum of the chunks' products.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 32, generator=g).bfloat16().to(device).requires_grad_()
    w = torch.randn(96, 32, generator=g).bfloat16().to(device).requires_grad_()
    t = torch.randint(0, 96, (40,), generator=g).to(device)
    linear_cross_entropy(h, w, t, chunk_size=16).backward()
    probs = torch.softmax((h.detach() @ w.detach().t()).float(), -1)
    grad_logits = ((probs - F.one_hot(t, 96).float()) / 40).bfloat16().float()  # ce_chunk rounds it to bf16
    want = grad_logits.t() @ h.detach().float()
    torch.testing.assert_close(w.grad.float(), want, rtol=2e-2, atol=2e-3)
    empty = torch.zeros(0, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    linear_cross_entropy(empty, w, torch.zeros(0, dtype=torch.long, device=device), num_items_in_batch=1).backward()
    assert empty.grad.shape == (0, 32)


def test_a_chunk_gradient_is_freed_before_the_next_chunk_logits():
    # While a chunk's loss is computed, only its logits and its gradient are alive (plan counts two [C, V] buffers,
    # LOSS_CHUNK_TOKENS): the previous chunk's gradient is dropped before the next chunk's logits are made.
    import weakref

    from moeshard.models.common import LOSS_CHUNK_TOKENS, ce_chunk

    assert LOSS_CHUNK_TOKENS == 4096  # the head's chunk, which plan's loss-head term counts
    previous: list[weakref.ref] = []

    def chunk_loss(logits_CV, targets_C):
        assert all(ref() is None for ref in previous), "an earlier chunk's gradient is still alive"
        loss, grad_CV = ce_chunk(logits_CV, targets_C)
        previous.append(weakref.ref(grad_CV))
        return loss, grad_CV

    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (20,), generator=g)
    linear_cross_entropy(h, w, t, chunk_size=6, chunk_loss=chunk_loss).backward()
    assert len(previous) == 4
