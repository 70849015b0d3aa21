"""``grouped_grad_accumulation``: FSDP2's float32 accumulation of bfloat16 gradients over micro-batches, done by one
Triton kernel per unit, gives FSDP2's own sums bit for bit (2 gloo ranks, triton interpreted on CPU; on
CUDA checked by the benchmark's losses, ``docs/performance.md``); and the kernel itself on odd shapes and both 16-bit
dtypes, and ``scaled_add_`` and ``scale_`` (interpreted, and compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeshard.meshes.testing import run_distributed

pytest.importorskip("triton")


def check_kernel(device: str) -> None:
    from moeshard.fsdp_moe._grad_triton import add_into_float32

    g = torch.Generator().manual_seed(0)
    shapes = [(5000,), (3, 7), (0,), (4096,), (2, 4097)]
    dsts = [torch.randn(s, generator=g).to(device) for s in shapes]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16]
    srcs = [torch.randn(s, generator=g).to(device, dt) for s, dt in zip(shapes, dtypes)]
    want = [d + s.float() for d, s in zip(dsts, srcs)]
    add_into_float32(dsts, srcs)
    for got, w in zip(dsts, want):
        assert torch.equal(got, w)
    with pytest.raises(ValueError, match="16-bit tensors into float32"):
        add_into_float32([dsts[0]], [srcs[1]])
    check_scaled_add(device)
    check_scale(device)


def check_scaled_add(device: str) -> None:
    """``scaled_add_`` (``ReducedGrad.add_`` with a scale, into a held CUDA gradient) against the two eager passes
    it replaces, with a partial last block."""
    from moeshard.fsdp_moe._grad_triton import scaled_add_

    g = torch.Generator().manual_seed(1)
    for n in (1, 4096, 5000):
        acc, grad = torch.randn(n, 3, generator=g).to(device), torch.randn(n, 3, generator=g).to(device)
        factor = torch.tensor([0.37], device=device)
        want = acc + grad * factor
        assert scaled_add_(acc, grad, factor) is acc
        torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-7)  # one rounding apart at most (a fused multiply-add)
    with pytest.raises(ValueError, match="float32 acc and g of one shape"):
        scaled_add_(acc.bfloat16(), grad, factor)
    with pytest.raises(ValueError, match="contiguous"):
        scaled_add_(acc[:, :2], grad[:, :2], factor)


def check_scale(device: str) -> None:
    """``scale_`` (``ReducedGrad.add_`` with a scale and no held gradient): the product in float32 for both dtypes,
    more blocks than programs (each program takes several), a partial last block, and the tensor's bits unchanged
    where the factor is one."""
    from moeshard.fsdp_moe._grad_triton import _ADD_BLOCK, _programs, scale_

    g = torch.Generator().manual_seed(2)
    blocks = 3 * _programs(torch.device(device)) + 1
    for n in (1, 5000, blocks * _ADD_BLOCK - 7):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(n, generator=g).to(device, dtype)
            for value in (0.37, 1.0, 3.0):
                factor = torch.tensor([value], device=device, dtype=dtype)
                want = (x.float() * factor.float()).to(dtype)
                got = scale_(x.clone(), factor)
                assert got.dtype == dtype
                if value == 1.0 or dtype == torch.float32:
                    assert torch.equal(got, want), (n, dtype, value)
                else:  # the interpreter's float32 -> bf16 cast may round the other way: one bf16 ulp at most
                    torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45], device=device)
    assert torch.equal(
        scale_(special.clone(), torch.ones(1, device=device)).view(torch.int32), special.view(torch.int32)
    )
    with pytest.raises(ValueError, match="contiguous tensor and a one-element factor"):
        scale_(torch.zeros(4, 4, device=device)[:, :2], torch.ones(1, device=device))


def _run(install: bool):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moeshard.fsdp_moe import _grad_triton, grouped_grad_accumulation

    rank = dist.get_rank()
    if install and rank == 0:
        from moeshard.ep.testing import interpreter_numpy_fix

        interpreter_numpy_fix()  # scale_'s runtime loop bound
        check_kernel("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mp_policy=mp)
    calls = []
    if install:
        assert grouped_grad_accumulation(model, interpreted=True) == 2  # the two layers' units (the root has none)
        assert grouped_grad_accumulation(model, interpreted=True) == 0  # already set up
        add = _grad_triton.add_into_float32
        _grad_triton.add_into_float32 = lambda d, s: (calls.append(len(d)), add(d, s))[1]
    g = torch.Generator().manual_seed(rank + 1)
    xs = [torch.randn(4, 16, generator=g) for _ in range(3)]
    try:
        for m, x in enumerate(xs):
            model.set_requires_gradient_sync(m == len(xs) - 1)
            model(x).float().pow(2).mean().backward()
    finally:
        if install:
            _grad_triton.add_into_float32 = add
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return grads, calls


def test_same_sums_as_fsdp2_in_the_interpreter():
    env = {"TRITON_INTERPRET": "1"}  # decided when triton is first imported: the ranks are fresh processes
    # (without interpreted=True the CPU units are left to FSDP2: the call list would be empty and this would fail)
    plain = run_distributed(_run, 2, False, env=env)
    grouped = run_distributed(_run, 2, True, env=env)
    for (want, _), (got, calls) in zip(plain, grouped):
        # the 2nd and 3rd backward of each of the two units: one launch for its weight and bias each time
        assert calls == [2, 2, 2, 2], calls
        assert want.keys() == got.keys()
        for name in want:
            assert want[name].dtype == torch.float32
            assert torch.equal(got[name], want[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda():
    check_kernel("cuda")


def _product_case(device: str) -> None:
    from types import SimpleNamespace

    from moeshard.fsdp_moe import ReducedGrad

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 5, generator=g).bfloat16().to(device), torch.randn(6, 3, generator=g).bfloat16().to(device)
    param = SimpleNamespace(
        reduce_dtype=torch.float32,
        _unsharded_param=torch.empty(5, 3, dtype=torch.bfloat16, device=device),
        unsharded_accumulated_grad=None,
    )
    held = ReducedGrad(param)
    product = a.float().t() @ b.float()
    held.add_product_(a.clone(), b, scale=torch.ones(1, device=device))  # none held: the product becomes it
    first = param.unsharded_accumulated_grad
    assert first.dtype == torch.float32 and first.shape == (5, 3)
    torch.testing.assert_close(first, product, rtol=2**-7, atol=1e-2)  # CPU: the bf16 product is rounded once
    held.add_product_(a.clone(), b, scale=torch.full((1,), 2.0, device=device))  # into the held one, scaled
    assert param.unsharded_accumulated_grad is first
    torch.testing.assert_close(first, 3 * product, rtol=2**-7, atol=3e-2)
    with pytest.raises(ValueError, match=r"\[M, N\] = \(5, 3\)"):
        held.add_product_(a, b[:, :2])
    # the factor in float32: 1.5 / 301 rounded once (a factor rounded to bf16 first is 1/300's: another value)
    param.unsharded_accumulated_grad = None
    one, ones = torch.full((1, 5), 1.5).bfloat16().to(device), torch.ones(1, 3).bfloat16().to(device)
    held.add_product_(one.clone(), ones, scale=torch.tensor(1 / 301, device=device))
    want = (one.float() * (1 / 301)).bfloat16().float().t() @ ones.float()
    assert torch.equal(param.unsharded_accumulated_grad, want)
    rounded = torch.tensor(1 / 301).bfloat16().float().to(device)
    assert not torch.equal(want, (one.float() * rounded).bfloat16().float().t() @ ones.float())


def test_a_product_added_into_the_held_gradient():
    # ReducedGrad.add_product_ (the LM head's later micro-batches): a^T b, times the scale, becomes or joins the
    # float32 gradient FSDP2 holds, with no other tensor; on CUDA in the GEMM's epilogue
    _product_case("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_product_added_into_the_held_gradient_on_cuda():
    _product_case("cuda")
