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
    # the product in float32 with the float32 factor (a 16-bit gradient never takes a rounded factor).
    from moeshard.models.common._lm_loss import _scaled

    g16, g32 = torch.randn(5, 3).bfloat16(), torch.randn(4)
    factor = torch.tensor(1 / 3)
    a, none, b = _scaled(g16, None, g32, factor=factor)
    assert none is None and a.dtype == torch.bfloat16 and b.dtype == torch.float32
    assert torch.equal(a, (g16.float() * factor).bfloat16()) and torch.equal(b, g32 * factor)
    ones = torch.full((64,), 1.5).bfloat16()
    by_300, by_301 = (_scaled(ones, factor=torch.tensor(1 / n))[0] for n in (300, 301))
    assert not torch.equal(by_300, by_301)  # bf16(1/300) == bf16(1/301): a rounded factor would not tell them apart


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

    def chunk_loss(logits_CV, targets_C, grad_scale):
        assert all(ref() is None for ref in previous), "an earlier chunk's gradient is still alive"
        loss, grad_CV = ce_chunk(logits_CV, targets_C, grad_scale)
        previous.append(weakref.ref(grad_CV))
        return loss, grad_CV

    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(30, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (20,), generator=g)
    linear_cross_entropy(h, w, t, chunk_size=6, chunk_loss=chunk_loss).backward()
    assert len(previous) == 4


class _Holder:
    """A gradient target that records what the head hands over (``ReducedGrad``'s interface)."""

    dtype = torch.float32

    def __init__(self):
        self.calls = []

    def add_(self, grad, scale=None):
        self.calls.append((grad.clone(), scale.clone()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("divisor", [None, 7, "tensor"])
def test_the_divisor_is_folded_into_the_logit_gradient(dtype, divisor):
    # bf16 and float32 logits: each chunk's gradient comes scaled by 1 / divisor (before its rounding), so the
    # backward of the plain loss hands the weight's float32 gradient over with a factor of exactly one, and with
    # the loss doubled, exactly two; float16 would flush small entries: scaled after the GEMMs, as before.
    from moeshard.models.common import ce_chunk

    g = torch.Generator().manual_seed(0)
    h = torch.randn(24, 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, 40, (24,), generator=g)
    t[[1, 9]] = -100
    num_items = torch.tensor(16383.0) if divisor == "tensor" else divisor  # 16,383: a divisor bf16 cannot hold
    d = {None: 22, 7: 7, "tensor": 16383}[divisor]
    scales = []

    def chunk_loss(logits_CV, targets_C, grad_scale):
        scales.append(grad_scale)
        return ce_chunk(logits_CV, targets_C, grad_scale)

    folds = dtype != torch.float16
    grads = {}
    for mult in (1.0, 2.0):
        holder = _Holder()
        h.grad = None
        loss = linear_cross_entropy(
            h, w, t, num_items, chunk_size=10, chunk_loss=chunk_loss, grad_target=lambda _, holder=holder: holder
        )
        (loss * mult + h.float().sum() * 0).backward()
        (grad_w, factor), *more = holder.calls
        assert not more and w.grad is None
        want_factor = torch.tensor(mult / d) if not folds else torch.tensor(mult)
        assert torch.equal(factor, want_factor.float()), (factor, want_factor)
        grads[mult] = (h.grad, grad_w * factor)
    assert len(scales) == 6
    for s in scales:
        if folds:
            assert s.dtype == torch.float32 and torch.equal(s, torch.tensor(1.0 / d, dtype=torch.float32))
        else:
            assert s is None
    if folds:  # a factor of two on gradients that hold their scale: exact (float16's are near its subnormals)
        assert torch.equal(grads[2.0][0], grads[1.0][0] * 2) and torch.equal(grads[2.0][1], grads[1.0][1] * 2)
    logits = (h.detach() @ w.detach().t()).float()
    ref_w = ((torch.softmax(logits, -1) - F.one_hot(t.clamp_min(0), 40)) * (t != -100)[:, None] / d).t() @ h.float()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # bf16 and float16: the logit gradient rounded to 8 or 11 bits
    torch.testing.assert_close(grads[1.0][1], ref_w.detach(), rtol=tol, atol=tol)


def test_no_scale_without_a_gradient():
    # evaluation (no grad) and inputs without gradients: the chunks get no scale, and no reciprocal is made
    seen = []

    def chunk_loss(logits_CV, targets_C, grad_scale):
        seen.append(grad_scale)
        return ce_chunk_any(logits_CV, targets_C, grad_scale)

    from moeshard.models.common import ce_chunk as ce_chunk_any

    h, w, t = torch.randn(4, 8).bfloat16(), torch.randn(10, 8).bfloat16(), torch.arange(4)
    with torch.no_grad():
        linear_cross_entropy(h.requires_grad_(), w, t, 3, chunk_loss=chunk_loss)
    linear_cross_entropy(h.detach(), w, t, 3, chunk_loss=chunk_loss)
    assert seen == [None, None]


def test_one_chunk_adds_its_product_into_a_held_gradient():
    # A target that holds a gradient already (FSDP2 between micro-batches that do not reduce) and a micro-batch of
    # one chunk: the head keeps the chunk's logit gradient and backward adds g^T h into the held gradient (the
    # target's add_product_); two chunks, or no held gradient, hand over the float32 product as before.
    class Held(_Holder):
        def __init__(self, held):
            super().__init__()
            self.grad, self.products = held, 0

        def held(self):
            return self.grad

        def add_product_(self, a, b, scale=None):
            self.products += 1
            self.grad += scale * (a.float().t() @ b.float())

    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (12,), generator=g)
    want = None
    for chunk, held in ((16, None), (16, torch.ones(40, 16)), (8, torch.ones(40, 16))):
        target = Held(held)
        loss = linear_cross_entropy(h, w, t, 12, chunk_size=chunk, grad_target=lambda _, target=target: target)
        (2 * loss).backward(retain_graph=True)
        if held is None:
            (grad, factor), *_ = target.calls
            want = grad * factor
            continue
        assert target.products == (1 if chunk == 16 else 0) and len(target.calls) == 1 - target.products
        got = target.grad - 1 if target.products else target.calls[0][0] * target.calls[0][1]
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-4)  # bf16 products on CPU: rounded per chunk
        if target.products:
            with pytest.raises(RuntimeError, match="ran twice"):
                loss.backward()


def test_bf16_gradients_follow_the_exact_divisor():
    # The divisor's reciprocal reaches a bf16 model's gradients unrounded. Before it was folded into the logit
    # gradient in float32, the backward multiplied the bf16 hidden-state gradient by 1/d cast to bf16: divisors 300
    # and 301 gave the same gradients bit for bit (ratio 1, exact 1.0033), 251 and 252 a ratio of 1.0077 (exact
    # 1.0040). Targets the model predicts, so that no crowd of equal logit-gradient entries rounds alike.
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(512, 64, generator=g).bfloat16()
    w0 = (torch.randn(1024, 64, generator=g) * 0.5).bfloat16()
    t = (h0.float() @ w0.float().t()).argmax(-1)

    def grads(n):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        linear_cross_entropy(h, w, t, n).backward()
        return h.grad.double().norm(), w.grad.double().norm()

    for n1, n2 in ((251, 252), (300, 301), (16383, 16384)):
        for a, b in zip(grads(n1), grads(n2)):
            assert abs(float(a / b) - n2 / n1) < 1e-3, (n1, n2, float(a / b), n2 / n1)  # rounding: 1e-4 to 2e-4
