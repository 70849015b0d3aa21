"""Weight gradients added into a buffer: the ``WeightGradTarget`` hand-off and the Triton grouped GEMM behind it.

- the kernel ``moeshard.ep._wgrad_triton.grouped_weight_grad`` against a float64 reference (uneven rows, an expert
  without rows, partial tiles, writing and adding, a factor), under triton's interpreter on CPU (a child process)
  and compiled on CUDA;
- the routed experts with a target over two micro-batches: the same gradients as autograd's accumulation, the
  buffers really used (the target asked, nothing returned for those weights), a target answering None changes
  nothing; the refusals.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from moeshard.ep import EPOptions, LocalDispatch, ParallelPlan, apply_ep, sum_weight_grads
from moeshard.ep.testing import interpreter_numpy_fix


def check_kernel(device: str, dtype: torch.dtype) -> int:
    """``grouped_weight_grad`` against float64, both modes, both kernels (pointers; TMA where the device has it);
    returns the number of cases checked."""
    from moeshard.ep._wgrad_triton import CONFIGS, TMA_CONFIGS, _tma_capable, grouped_weight_grad

    test = {"BLOCK_M": 16, "BLOCK_K": 16, "BLOCK_R": 16, "num_warps": 4, "num_stages": 2}
    CONFIGS.setdefault("test", test)
    TMA_CONFIGS.setdefault("test", test)
    kernels = [False, True] if _tma_capable(torch.device(device)) else [False]
    cases = 0
    for tma in kernels:
        cases += _check_kernel(device, dtype, grouped_weight_grad, tma)
        cases += _check_parts(device, dtype, tma)
    return cases


def _check_parts(device, dtype, tma: bool) -> int:
    """``grouped_weight_grad_parts`` (each part's rows grouped by expert, an expert without rows in each part; 1, 2
    and 5 parts, i.e. one launch and an accumulating second one) against float64, writing and adding; and the
    overlapped dispatcher's three parts (row views at a storage offset, offsets widened over all experts)."""
    from moeshard.ep._wgrad_triton import grouped_weight_grad_parts

    g = torch.Generator().manual_seed(1)
    E, M, K = 3, 32, 16
    for P in (1, 2, 5):
        parts, ref = [], torch.zeros(E, M, K, dtype=torch.float64)
        for p in range(P):
            counts = torch.randint(0, 20, (E,), generator=g)
            counts[p % E] = 0
            offs = torch.cumsum(counts, 0).to(torch.int32)
            N = int(counts.sum()) + 2  # rows past the last expert's: never read
            a, b = torch.randn(N, M, generator=g), torch.randn(N, K, generator=g)
            starts = [0, *offs[:-1].tolist()]
            ref += torch.stack([a[s:e].double().T @ b[s:e].double() for s, e in zip(starts, offs.tolist())])
            parts.append((a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), offs.to(device)))
        out = torch.full((E, M, K), float("nan"), device=device, dtype=dtype)
        sq_out, sq_acc = (torch.full((), float("nan"), device=device) for _ in range(2))
        grouped_weight_grad_parts(parts, out, accumulate=False, config="test", tma=tma, squares=sq_out)
        old = torch.randn(E, M, K, generator=g)
        acc = old.clone().to(device=device, dtype=dtype)
        grouped_weight_grad_parts(parts, acc, accumulate=True, alpha=0.5, config="test", tma=tma, squares=sq_acc)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for got, want, sq in ((out, ref, sq_out), (acc, old.double() + 0.5 * ref, sq_acc)):
            # the epilogue's sum of squares is that of the values written (rounded), over the last launch's
            written = got.double().cpu().square().sum()
            assert abs(sq.item() - written) <= 1e-5 * written, (tma, P, sq.item(), written.item())
            got = got.double().cpu()
            assert (got - want).norm() / want.norm() < tol, (tma, P, ((got - want).norm() / want.norm()).item())
    # The overlapped dispatcher's parts: two halves of the own copies, row views of one tensor (the second at a
    # storage offset), with offsets widened over all experts (no rows outside the half), and the received copies.
    from moeshard.ep._dispatch.overlapped import _widen

    E, half = 4, 2
    own, recv = torch.randint(1, 9, (E,), generator=g), torch.randint(0, 9, (E,), generator=g)
    a, b = torch.randn(int(own.sum()), M, generator=g), torch.randn(int(own.sum()), K, generator=g)
    a_r, b_r = torch.randn(int(recv.sum()), M, generator=g), torch.randn(int(recv.sum()), K, generator=g)
    split = int(own[:half].sum())
    to = dict(device=device, dtype=dtype)
    parts = [
        (a.to(**to)[:split], b.to(**to)[:split], _widen(torch.cumsum(own[:half], 0).to(torch.int32), 0, E)),
        (a_r.to(**to), b_r.to(**to), torch.cumsum(recv, 0).to(torch.int32)),
        (a.to(**to)[split:], b.to(**to)[split:], _widen(torch.cumsum(own[half:], 0).to(torch.int32), half, E)),
    ]
    parts = [(x, y, o.to(device)) for x, y, o in parts]
    assert parts[2][0].storage_offset() == split * M and parts[2][2].tolist()[:half] == [0] * half
    bounds = [0, *torch.cumsum(own, 0).tolist()]
    rbounds = [0, *torch.cumsum(recv, 0).tolist()]
    ref = torch.stack(
        [
            a[bounds[e] : bounds[e + 1]].double().T @ b[bounds[e] : bounds[e + 1]].double()
            + a_r[rbounds[e] : rbounds[e + 1]].double().T @ b_r[rbounds[e] : rbounds[e + 1]].double()
            for e in range(E)
        ]
    )
    out = torch.full((E, M, K), float("nan"), **to)
    grouped_weight_grad_parts(parts, out, accumulate=False, config="test", tma=tma)
    got = out.double().cpu()
    assert (got - ref).norm() / ref.norm() < (1e-5 if dtype == torch.float32 else 1e-2), ("halves", tma)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_weight_grad_parts(
            [(torch.zeros(4, 3), torch.zeros(4, 2), torch.tensor([4]))], torch.zeros(1, 2, 3), accumulate=False
        )
    with pytest.raises(ValueError, match="one-element float32"):
        grouped_weight_grad_parts(parts, out, accumulate=False, squares=torch.zeros(2, device=device))
    return 1


def _check_kernel(device, dtype, grouped_weight_grad, tma: bool) -> int:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for counts, M, K in (([0, 37, 5, 20], 40, 24), ([16, 16, 0], 32, 16)):
        offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        N = sum(counts) + 3  # rows past the last expert's: never read
        a, b = torch.randn(N, M, generator=g), torch.randn(N, K, generator=g)
        starts = [0, *offs[:-1].tolist()]
        ref = torch.stack([a[s:e].double().T @ b[s:e].double() for s, e in zip(starts, offs.tolist())])
        old = torch.randn(len(counts), M, K, generator=g)
        dev = [t.to(device=device, dtype=dtype) for t in (a, b)]
        out = torch.full((len(counts), M, K), float("nan"), device=device, dtype=dtype)  # every element written
        grouped_weight_grad(*dev, offs.to(device), out, accumulate=False, config="test", tma=tma)
        acc = old.to(device=device, dtype=dtype)
        want_acc = acc.double().cpu() + 0.5 * ref
        grouped_weight_grad(*dev, offs.to(device), acc, accumulate=True, alpha=0.5, config="test", tma=tma)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for got, want in ((out, ref), (acc, want_acc)):
            got = got.double().cpu()
            assert not got.isnan().any()
            assert (got - want).norm() / want.norm() < tol, (tma, ((got - want).norm() / want.norm()).item())
        empty = counts.index(0)
        assert torch.equal(out[empty].cpu(), torch.zeros(M, K, dtype=dtype))
        assert torch.equal(acc[empty].cpu(), old[empty].to(dtype))  # an expert without rows keeps its gradient
        cases += 1
    with pytest.raises(ValueError, match="do not fit"):
        grouped_weight_grad(
            torch.zeros(4, 3), torch.zeros(4, 2), torch.tensor([4]), torch.zeros(1, 2, 3), accumulate=True
        )
    if tma:  # 12-byte rows: TMA cannot read them, and a forced TMA kernel says so
        with pytest.raises(ValueError, match="TMA needs"):
            rows = torch.zeros(4, 3, device=device, dtype=dtype)
            grouped_weight_grad(
                rows, rows, torch.tensor([4], device=device), torch.zeros(1, 3, 3), accumulate=True, tma=True
            )
    return cases


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # decided when triton is first imported: a fresh process
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked 6 cases" in run.stdout  # both kernels, and their parts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda(dtype):
    pytest.importorskip("triton")
    assert check_kernel("cuda", dtype) == 6


def _weights(E, D, F, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * F, D, generator=g) / D**0.5).to(device=device, dtype=dtype).requires_grad_()
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).to(device=device, dtype=dtype).requires_grad_()
    return w1, w2


def _micro_batches(
    options, *, target=None, device="cpu", dtype=torch.float32, T=48, K=2, E=4, D=16, F=8, finish=lambda w1, w2: None
):
    """Gradients of w1, w2 after two micro-batches through one ``LocalDispatch`` (a target, or autograd's sum), and
    ``finish(w1, w2)`` (what the target does after the last backward)."""
    w1, w2 = _weights(E, D, F, device, dtype)
    dispatch = LocalDispatch(E, options)
    dispatch.accumulate_weight_grads(target(w1, w2) if target else None)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(T, D, generator=g).to(device=device, dtype=dtype)
        weights, ids = torch.softmax(torch.randn(T, E, generator=g), -1).topk(K, dim=-1)
        y = dispatch(x, ids.to(device), weights.to(device), w1, w2)
        (y.float() * torch.randn(T, D, generator=g).to(device)).sum().backward()
    finish(w1, w2)
    return w1.grad.clone(), w2.grad.clone()


class _GradTarget:
    """What a gradient owner does (``moeshard.fsdp_moe``'s local experts): the gradient so far, once there is one."""

    def __init__(self, w1, w2, answer=True):
        self.params, self.answer, self.asked, self.given = (w1, w2), answer, 0, 0

    def __call__(self, weight):
        self.asked += 1
        for p in self.params:
            if p is weight and p.grad is not None and self.answer:
                self.given += 1
                return p.grad
        return None


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
def test_target_adds_into_the_gradient_like_autograd(gemm):
    options = EPOptions(gemm=gemm)
    want = _micro_batches(options)
    targets = []

    def make(w1, w2):
        targets.append(_GradTarget(w1, w2))
        return targets[-1]

    got = _micro_batches(options, target=make)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # asked for both weights in each backward; the second one added into the first one's gradient
    assert targets[0].asked == 4 and targets[0].given == 2


class _TakingTarget(_GradTarget):
    """A target that keeps every pass's factors (``take``) and forms them at the end with ``sum_weight_grads``."""

    def __init__(self, w1, w2):
        super().__init__(w1, w2)
        self.kept = {id(w1): [], id(w2): []}

    def take(self, weight, factors):
        if id(weight) not in self.kept:
            return False
        self.kept[id(weight)].append(factors)
        return True

    def form(self):
        for p in self.params:
            p.grad = sum_weight_grads(self.kept.pop(id(p)))


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
def test_a_target_takes_the_factors_and_forms_them_later(gemm):
    """Each backward hands each weight's gradient over as factors (nothing returned, no buffer asked); formed from
    both micro-batches' factors in one call, they equal autograd's sum."""
    options = EPOptions(gemm=gemm)
    want = _micro_batches(options)
    targets = []

    def finish(w1, w2):
        assert w1.grad is None and w2.grad is None and targets[0].asked == 0
        assert [len(k) for k in targets[0].kept.values()] == [2, 2]
        targets[0].form()

    got = _micro_batches(
        options, target=lambda w1, w2: targets.append(_TakingTarget(w1, w2)) or targets[-1], finish=finish
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="at least one"):
        sum_weight_grads([])


class _ExpectingTarget(_TakingTarget):
    """A taking target that also hears, in each forward, what keeping that pass's factors would hold."""

    def __init__(self, w1, w2):
        super().__init__(w1, w2)
        self.expected = []

    def expect_factors(self, elements):
        self.expected.append(elements)


def test_the_dispatcher_reports_what_its_factors_hold():
    """``expect_factors``: told in each forward, from shapes, the elements that the pass's factors (both weights)
    then hold, ``T · K · (2D + 3F)``; ``kept_factor_elements`` gives the same number by name, and adds the
    overlapped dispatcher's sorted rows at EP > 1."""
    from moeshard.ep import kept_factor_elements

    targets = []
    T, K, D, F = 48, 2, 16, 8

    def finish(w1, w2):
        kept = [f for fs in targets[0].kept.values() for f in fs]
        assert len(kept) == 4  # 2 weights x 2 micro-batches
        assert targets[0].expected == [T * K * (2 * D + 3 * F)] * 2
        assert sum(f.a.numel() + f.b.numel() for f in kept) == sum(targets[0].expected)
        targets[0].form()

    _micro_batches(
        EPOptions(), target=lambda w1, w2: targets.append(_ExpectingTarget(w1, w2)) or targets[-1], finish=finish
    )
    rows = T * K
    for dispatch in ("overlapped", "all_to_all"):
        assert kept_factor_elements(dispatch, 1, rows, D, F) == rows * (2 * D + 3 * F)  # EP 1: the local one
    assert kept_factor_elements("all_to_all", 4, rows, D, F) == rows * (2 * D + 3 * F)
    assert kept_factor_elements("overlapped", 4, rows, D, F) == rows * (2 * D + 3 * F) + rows * 2 * D * 3 / 4
    with pytest.raises(ValueError, match="dispatch must be one of"):
        kept_factor_elements("tokens", 2, rows, D, F)


def test_a_target_answering_none_changes_nothing():
    want = _micro_batches(EPOptions(gemm="loop"))
    got = _micro_batches(EPOptions(gemm="loop"), target=lambda w1, w2: _GradTarget(w1, w2, answer=False))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_tier_adds_inside_the_gemm_on_cuda():
    pytest.importorskip("triton")
    kw = dict(device="cuda", dtype=torch.bfloat16, T=512, K=4, E=8, D=256, F=128)
    options = EPOptions(kernels="triton", gemm="grouped_mm")
    want = _micro_batches(options, **kw)
    got = _micro_batches(options, target=_GradTarget, **kw)
    for a, b in zip(got, want, strict=True):  # one rounding of the sum (in the GEMM) against two (GEMM, then add)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.abs().max().item())


class _Experts(nn.Module):
    def __init__(self, E=4, D=16, F=8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, D))
        self.down_proj = nn.Parameter(torch.randn(E, D, F))
        self.dispatch = LocalDispatch(E)


class _Plain(nn.Module):  # an expert module with its own backward (no dispatcher)
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 16))


def test_refusals_name_the_problem():
    model = nn.ModuleDict({"a": _Experts(), "b": _Plain()})
    plan = ParallelPlan({"*.gate_up_proj": torch.distributed.tensor.Shard(0)})
    info = apply_ep(model, plan, None)
    assert info.routes(model["a"]) and not info.routes(model["b"]) and not info.routes(_Experts())
    with pytest.raises(ValueError, match="not an expert module of this EPInfo"):
        info.accumulate_weight_grads(_Experts(), lambda w: None)
    with pytest.raises(ValueError, match="no moeshard.ep dispatcher"):
        info.accumulate_weight_grads(model["b"], lambda w: None)
    with pytest.raises(ValueError, match="must be callable"):
        info.accumulate_weight_grads(model["a"], 3)
    info.accumulate_weight_grads(model["a"], None)
    assert model["a"].dispatch.weight_grads is None


if __name__ == "__main__":  # the interpreter run of test_kernel_in_the_interpreter
    interpreter_numpy_fix()
    # float32 operands only: the interpreter's bf16 dot is wrong (checked compiled on CUDA instead)
    print(f"checked {check_kernel('cpu', torch.float32)} cases")
