"""Every function of ``moeshard.models.common._torch_internals`` against the installed torch, on the CPU (a DTensor
over the in-process ``fake`` backend: one rank of four). Where torch moved an internal, the function raises the
line naming torch's version and that internal, which is this test's failure message."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moeshard.meshes import fake_process_group
from moeshard.models.common import _torch_internals as ti


def test_every_internal_is_where_it_is_read():
    with fake_process_group(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2))
        # rank 2 is (1, 0) on the 2 x 2 mesh: second half of dim 0, the whole of dim 1
        param = DTensor.from_local(torch.zeros(5, 3), mesh, [Shard(0), Replicate()], run_check=False)
        assert param.shape == (10, 3) and dist.get_rank() == 2
        assert ti.shard_offset(param) == (5, 0)
    (a, b) = ti.foreach_mul([torch.ones(2), torch.full((3,), 2.0)], torch.tensor(1.5))
    assert torch.equal(a, torch.full((2,), 1.5)) and torch.equal(b, torch.full((3,), 3.0))


def test_the_attention_kernels_match_scaled_dot_product_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    out, lse = ti.causal_attention_cpu(q.detach(), k.detach(), v.detach(), 0.3)
    torch.testing.assert_close(out, expected.detach())
    assert lse.shape == (2, 3, 5)
    grads = ti.causal_attention_cpu_backward(grad_out, q.detach(), k.detach(), v.detach(), out, lse, 0.3)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
    if not torch.cuda.is_available():
        return
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    expected.backward(grad_out.to(expected))
    out, lse, seed, offset = ti.causal_attention_cudnn(q.detach(), k.detach(), v.detach(), 0.3)
    torch.testing.assert_close(out, expected.detach(), rtol=2e-2, atol=2e-2)
    grads = ti.causal_attention_cudnn_backward(
        grad_out.to(out), q.detach(), k.detach(), v.detach(), out, lse, seed, offset, 0.3
    )
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        ("causal_attention_cpu", "_scaled_dot_product_flash_attention_for_cpu"),
        ("causal_attention_cpu_backward", "_scaled_dot_product_flash_attention_for_cpu_backward"),
        ("causal_attention_cudnn", "_scaled_dot_product_cudnn_attention"),
        ("causal_attention_cudnn_backward", "_scaled_dot_product_cudnn_attention_backward"),
    ],
)
def test_a_moved_attention_kernel_is_named_with_torchs_version(monkeypatch, fn, op):
    class Gone:  # torch.ops.aten of a torch that dropped the op
        def __getattr__(self, name):
            if name == op:
                raise AttributeError(name)
            return getattr(torch.ops.aten, name)

    monkeypatch.setattr(torch.ops, "aten", Gone())
    line = rf"^torch {re.escape(torch.__version__)}: torch\.ops\.aten no longer has {op} "
    line += rf"\(used by moeshard\.models\.common\._torch_internals\.{fn}\)$"
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(RuntimeError, match=line):
        getattr(ti, fn)(*[x] * (len(inspect.signature(getattr(ti, fn)).parameters) - 1), 1.0)


def _all_reduce_both_ways():
    """On each rank: :func:`all_reduce_sum` and the deprecated ``torch.distributed.nn.functional.all_reduce`` on the
    same rank-dependent, non-contiguous input, forward and backward, and the warnings each gave."""
    import warnings

    from torch.distributed.nn.functional import all_reduce as deprecated

    rank = dist.get_rank()
    results = {}
    for name, fn in (("ours", ti.all_reduce_sum), ("torch", deprecated)):
        x = (torch.arange(6.0).view(3, 2).t() * (rank + 1)).requires_grad_(True)
        assert not x.is_contiguous()  # [2, 3] with [3, 2]'s strides: the copy must still be laid out alike
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = fn(x, group=dist.group.WORLD)
            (y * torch.full_like(y, 10.0**rank)).sum().backward()
        results[name] = (
            y.detach(),
            x.grad,
            torch.equal(x.detach(), torch.arange(6.0).view(3, 2).t() * (rank + 1)),  # the input is left as it was
            [w.category.__name__ for w in caught],
        )
    return results


def test_all_reduce_sum_is_the_deprecated_all_reduce_without_its_warning():
    from moeshard.meshes.testing import run_distributed

    base = torch.arange(6.0).view(3, 2).t()
    for res in run_distributed(_all_reduce_both_ways, 2):
        y, grad, kept, warned = res["ours"]
        assert torch.equal(y, base * (1 + 2))  # rank 0's input plus rank 1's (twice rank 0's)
        assert torch.equal(grad, torch.full((2, 3), 1.0 + 10.0))  # each rank's output gradient, summed
        assert kept and warned == []
        y_old, grad_old, kept_old, warned_old = res["torch"]
        assert torch.equal(y, y_old) and torch.equal(grad, grad_old) and kept_old
        assert "FutureWarning" in warned_old  # why ours exists; once torch drops the old one, drop this comparison


def test_has_call_hooks_sees_every_kind_of_hook(monkeypatch):
    linear = torch.nn.Linear(4, 4, bias=False)
    assert not ti.has_call_hooks(linear)
    for register in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"):
        handle = getattr(linear, register)(lambda *args: None)
        assert ti.has_call_hooks(linear), register
        handle.remove()
        assert not ti.has_call_hooks(linear), register
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)  # on every module
    try:
        assert ti.has_call_hooks(linear)
    finally:
        handle.remove()
    monkeypatch.setattr(linear, "_forward_hooks", None)  # a torch that keeps them elsewhere
    with pytest.raises(RuntimeError, match=r"torch .*: torch\.nn\.Module no longer keeps _forward_hooks \(used by "):
        ti.has_call_hooks(linear)
