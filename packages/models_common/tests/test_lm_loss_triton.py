"""The LM head's loss chunk as a Triton kernel (``ce_chunk_triton``) against :func:`ce_chunk`.

On CPU it runs under triton's interpreter (a child process with ``TRITON_INTERPRET=1``); on a CUDA machine the same
checks run compiled, plus the chunk at the model's vocabulary width.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from moeshard.models.common import ce_chunk  # noqa: E402


def check(device: str, dtype: torch.dtype, c: int, v: int) -> None:
    # the kernel itself, on CUDA or in the interpreter on CPU (ce_chunk_triton sends CPU tensors to ce_chunk)
    from moeshard.models.common._lm_loss_triton import launch

    g = torch.Generator().manual_seed(c * 7 + v)
    logits = (torch.randn(c, v, generator=g) * 4).to(device, dtype)
    targets = torch.randint(0, v, (c,), generator=g).to(device)
    targets[::3] = -100
    loss, grad = launch(logits, targets)
    want_loss, want_grad = ce_chunk(logits, targets)
    assert grad.dtype == dtype and grad.shape == (c, v)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    tol = 0 if dtype == torch.float32 else 8e-3  # one bf16 rounding apart at most
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=max(tol, 1e-5), atol=max(tol, 1e-6))
    assert torch.all(grad[::3] == 0)  # ignored rows: no gradient
    wide = torch.randn(c, v + 5, generator=g).to(device, dtype)
    strided = wide[:, :v]  # a view with a row stride of its own
    torch.testing.assert_close(launch(strided, targets)[0], ce_chunk(strided, targets)[0], rtol=1e-5, atol=1e-4)
    empty = launch(torch.zeros(0, v, dtype=dtype, device=device), targets[:0])
    assert empty[0].item() == 0 and empty[1].shape == (0, v)
    # With the loss's divisor folded in: the same loss, the gradient times the scale in float32 before its rounding.
    scale = torch.tensor(1 / 16383, device=device)
    scaled_loss, scaled = launch(logits, targets, scale)
    want_scaled = ce_chunk(logits, targets, scale)[1]
    assert torch.equal(scaled_loss, loss) and scaled.dtype == dtype
    torch.testing.assert_close(scaled.float(), want_scaled.float(), rtol=max(tol, 1e-5), atol=max(tol, 1e-6) * 1e-4)
    torch.testing.assert_close(scaled.float(), (grad.float() * scale).to(dtype).float(), rtol=2 * tol + 1e-6, atol=0)
    with pytest.raises(ValueError, match="grad_scale must be one element"):
        launch(logits, targets, torch.ones(2, device=device))
    # Over the logits: the same loss and bits, in their storage (rows read before written, each by its program).
    for s in (None, scale):
        temp = logits.clone()
        over_loss, over = launch(temp, targets, s, in_place=True)
        assert over.data_ptr() == temp.data_ptr() and torch.equal(over_loss, loss)
        assert torch.equal(over, grad if s is None else scaled)
    base = wide.clone()  # rows with a stride of their own: written in place, the columns past V untouched
    over = launch(base[:, :v], targets, in_place=True)[1]
    # The out-of-place gradient's rows (stride V) and these (V + 5) differ in alignment, and triton compiles the two
    # launches apart: on an H100 97 of 38.9M elements one bf16 rounding apart at V = 151,936, the loss the same.
    assert over.data_ptr() == base.data_ptr()
    torch.testing.assert_close(
        over.float(), launch(strided, targets)[1].float(), rtol=max(tol, 1e-5), atol=max(tol, 1e-6)
    )
    assert torch.equal(base[:, v:], wide[:, v:])
    # Rows as aligned as the out-of-place ones (V + 16 columns): the same bits.
    wide16 = torch.randn(c, v + 16, generator=g).to(device, dtype)
    over16 = launch(wide16.clone()[:, :v], targets, in_place=True)[1]
    assert torch.equal(over16, launch(wide16[:, :v], targets)[1])
    temp = strided.t().contiguous().t()  # columns apart (stride(-1) != 1): written over a contiguous copy
    over = launch(temp, targets, in_place=True)[1]
    assert torch.equal(temp, strided) and torch.equal(over, launch(strided, targets)[1])


CASES = [(torch.float32, 5, 300), (torch.bfloat16, 7, 5000)]  # V: inside one block, over two with a partial one


def test_matches_ce_chunk_in_the_interpreter():
    # triton decides interpreted or compiled when it is first imported: a fresh process with TRITON_INTERPRET=1
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"checked {len(CASES)} cases" in run.stdout


def test_kernel_compiles_for_hopper():
    """The kernel at the model's shapes compiles for sm_90 without a GPU (lowering and PTX, which the interpreter
    never runs)."""
    from moeshard.ep.testing import compile_for_hopper
    from moeshard.models.common._lm_loss_triton import _BLOCK_V, _ce_kernel

    bf, i64, f32 = (torch.empty(0, dtype=d, device="meta") for d in (torch.bfloat16, torch.int64, torch.float32))
    for has_scale in (False, True):
        k = compile_for_hopper(
            _ce_kernel, bf, i64, bf, f32, f32, 151936, 151936, 151936, IGNORE=-100, BLOCK_V=_BLOCK_V,
            HAS_SCALE=has_scale, num_warps=8,
        )  # fmt: skip
        assert k.asm["cubin"]


def test_cpu_tensors_take_the_eager_function():
    from moeshard.models.common._lm_loss_triton import ce_chunk_triton, ce_chunk_triton_

    logits, targets, scale = torch.randn(3, 11), torch.tensor([1, -100, 4]), torch.tensor(0.25)
    for a, b in zip(ce_chunk_triton(logits, targets), ce_chunk(logits, targets)):
        assert torch.equal(a, b)
    for a, b in zip(ce_chunk_triton(logits, targets, scale), ce_chunk(logits, targets, scale)):
        assert torch.equal(a, b)
    temp = logits.clone()
    loss, grad = ce_chunk_triton_(temp, targets, scale)  # over the logits: the same results, in their storage
    assert grad is temp and torch.equal(loss, ce_chunk(logits, targets)[0])
    assert torch.equal(grad, ce_chunk(logits, targets, scale)[1])


def test_the_head_with_the_gradient_over_its_logits():
    """The chunked head with ``ce_chunk_triton_`` (the CPU path: the gradient copied over the logits) gives the
    loss and gradients of ``ce_chunk``, over several chunks and with a held float32 target."""
    from moeshard.models.common import linear_cross_entropy
    from moeshard.models.common._lm_loss_triton import ce_chunk_triton_

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(10, 8, generator=g, dtype=torch.float64), torch.randn(30, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 30, (10,), generator=g)
    t[2] = -100
    results = []
    for chunk_loss in (ce_chunk, ce_chunk_triton_):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, t, 7, chunk_size=4, chunk_loss=chunk_loss)
        loss.backward()
        results.append((loss, hh.grad, ww.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_parallelize_gives_the_head_the_kernel_with_the_triton_tier_on_cuda(monkeypatch):
    from types import SimpleNamespace

    from moeshard.ep import EPOptions
    from moeshard.models.common import LMHead, ParallelOptions, TopKRouter
    from moeshard.models.common._causal_lm import LayerExecution
    from moeshard.models.common._layers import RMSNorm
    from moeshard.models.common._lm_loss_triton import ce_chunk_triton_
    from moeshard.models.common._parallelize import _compile
    from moeshard.models.common._topk_triton import topk_ids_op

    class Layer(torch.nn.Module):
        execution = LayerExecution()

        def __init__(self):
            super().__init__()
            self.router = TopKRouter(8, 4, 2, True)

        def attention_half(self, x):
            return x

    compiled = []  # what torch.compile was given
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **k: compiled.append(fn) or compile_(fn, *a, **k))
    for cuda in (True, False):  # without CUDA the tier means the compiled function, as moeshard.ep's tier does
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for kernels in ("triton", "compiled"):
            decoder = SimpleNamespace(layers=[Layer()], norm=RMSNorm(8, 1e-6))
            model = SimpleNamespace(model=decoder, lm_head=LMHead(8, 16))
            _compile(model, kernels)  # step 3 of parallelize; nothing compiles before a call
            triton_tier = cuda and kernels == "triton"
            head, layer = model.lm_head.options, decoder.layers[0]
            assert (head.chunk_loss is ce_chunk_triton_) == triton_tier  # the gradient over the logits
            assert (layer.router.selection.kernel is topk_ids_op) == triton_tier  # the routers' selection
            assert layer.execution.attention_half is not None  # the layer's half, compiled, in its execution
            assert any(getattr(fn, "__self__", None) is decoder.norm for fn in compiled)  # the final norm's call
            assert not vars(decoder.norm).keys() & {"forward", "__call__"}  # nothing patched on the instance
    lines = ParallelOptions(compile=True, ep=EPOptions(kernels="triton")).describe()
    assert "compile: attention half of each decoder layer, final norm, loss chunk (a triton kernel on CUDA)" in lines


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,c,v", [*CASES, (torch.bfloat16, 256, 151936)])
def test_matches_ce_chunk_on_cuda(dtype, c, v):
    from moeshard.models.common._lm_loss_triton import ce_chunk_triton, launch

    check("cuda", dtype, c, v)
    logits, targets = torch.randn(3, v, device="cuda").to(dtype), torch.tensor([1, -100, 2], device="cuda")
    assert torch.equal(ce_chunk_triton(logits, targets)[1], launch(logits, targets)[1])  # CUDA tensors: the kernel


if __name__ == "__main__":  # the interpreter run of test_matches_ce_chunk_in_the_interpreter
    from moeshard.ep.testing import interpreter_numpy_fix

    interpreter_numpy_fix()
    for case in CASES:
        check("cpu", *case)
    print(f"checked {len(CASES)} cases")
