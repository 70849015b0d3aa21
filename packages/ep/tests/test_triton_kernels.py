"""The triton kernels of ``moeshard.ep._triton`` against the eager functions they replace on CUDA.

On CPU they run under triton's interpreter (a child process with ``TRITON_INTERPRET=1``);
on a CUDA machine the same checks run compiled, plus the whole routed-experts path with the triton tier
(``EPOptions(kernels="triton")``) against the compiled one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from moeshard.ep import EPOptions
from moeshard.ep import _kernels as k  # noqa: E402
from moeshard.ep._dispatch import routed_experts
from moeshard.ep._permute import inverse_permutation, sort_by_expert  # noqa: E402
from moeshard.ep.testing import interpreter_numpy_fix  # noqa: E402


def _triton_module():
    from moeshard.ep import _triton

    return _triton


def _routing(T, K, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    order, _ = sort_by_expert(ids, E)
    return order, inverse_permutation(order)


def check_kernels(device: str, dtype: torch.dtype, D: int) -> None:
    tk = _triton_module()
    T, K, E = 29, 4, 8
    order, inv = _routing(T, K, E, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    y = torch.randn(T * K, D, generator=g).to(device, dtype)
    ulp = 0 if dtype == torch.float32 else 1e-2

    assert torch.equal(tk.expand_rows(x, order, inv, K), x[order // K])
    # a token's copies added in float32 and rounded once (the combine, and the copies' gradient sum): as the float32
    # sum cast by torch (round to nearest even) on the GPU; triton's interpreter rounds by truncation, so on CPU
    # within one bf16 ulp
    got = tk.gather_sum(y, inv, K)
    assert got.dtype == dtype
    want = y.float()[inv].view(T, K, D).sum(dim=1)
    if device == "cuda":
        assert torch.equal(got, want.to(dtype))
    torch.testing.assert_close(got.float(), want, rtol=ulp, atol=ulp * 4)
    torch.testing.assert_close(got.float(), k.gather_sum(y, inv, K).float(), rtol=ulp, atol=ulp * 4)
    # SwiGLU's gated activation (h = [gate | up], width 2D) and its gradient; float32 arithmetic, one rounding
    h = torch.randn(T * K, 2 * D, generator=g).to(device, dtype)
    ga = torch.randn(T * K, D, generator=g).to(device, dtype)
    tol = max(ulp, 1e-5)  # float32: sigmoid's rounding differs from torch's by an ulp
    a = tk.silu_gated(h)
    assert a.dtype == dtype and a.shape == (T * K, D)
    torch.testing.assert_close(a.float(), k.gated("silu", h.float()), rtol=tol, atol=tol)
    gh = tk.silu_gated_backward(h, ga)
    assert gh.dtype == dtype and gh.shape == h.shape
    torch.testing.assert_close(gh.float(), k.gated_backward("silu", h.float(), ga.float()), rtol=tol, atol=tol)
    # under autograd: the same gradient as autograd through the eager function
    hr = h.detach().float().requires_grad_()
    want = torch.autograd.grad(k.gated("silu", hr), hr, ga.float())[0]
    hr2 = h.detach().requires_grad_()
    assert torch.equal(tk.gated(h), a)  # nothing recorded: the bare kernel
    assert tk.gated(hr2).grad_fn is not None  # recorded: through the Function (the plain expert path)
    got = torch.autograd.grad(tk.gated(hr2), hr2, ga)[0]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def check_bad_shapes() -> None:
    tk = _triton_module()
    with pytest.raises(ValueError, match="T\\*K"):
        tk.gather_sum(torch.zeros(6, 4), torch.arange(5), 2)
    with pytest.raises(ValueError, match="rows, D"):
        tk.expand_rows(torch.zeros(6), torch.arange(6), torch.arange(6), 2)
    with pytest.raises(ValueError, match="inverse differ"):
        tk.expand_rows(torch.zeros(3, 4), torch.arange(4), torch.arange(6), 2)
    with pytest.raises(ValueError, match="rows of x"):
        tk.expand_rows(torch.zeros(4, 4), torch.arange(6), torch.arange(6), 2)
    with pytest.raises(ValueError, match="2F"):
        tk.silu_gated(torch.zeros(6, 5))
    with pytest.raises(ValueError, match="expected"):
        tk.silu_gated_backward(torch.zeros(6, 4), torch.zeros(6, 4))


def check_route(device: str) -> int:
    """The counting-sort route against the sort path: the same stable order, inverse and counts, exactly."""
    from moeshard.ep._route_triton import route

    g = torch.Generator().manual_seed(2)
    cases = 0
    # (T, K, E): blocks of 64 copies, partial and several; experts not a power of two; one expert; no token;
    # all copies to a few experts (long runs across blocks)
    for T, K, E, skew in [
        (29, 4, 8, 0),
        (300, 8, 128, 0),
        (300, 8, 128, 3),
        (1, 1, 1, 0),
        (0, 8, 16, 0),
        (130, 2, 5, 0),
        (64, 8, 256, 0),
        (257, 3, 1000, 40),
    ]:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)] or [torch.zeros(0, K).long()]).view(
            T, K
        )
        if skew:
            ids = ids % skew
        order, inv, counts = route(ids.to(device), E)
        want, want_counts = sort_by_expert(ids, E)
        assert order.dtype == inv.dtype == counts.dtype == torch.int64, (order.dtype, inv.dtype, counts.dtype)
        assert torch.equal(order.cpu(), want), (T, K, E, skew)
        assert torch.equal(inv.cpu(), inverse_permutation(want)) and torch.equal(counts.cpu(), want_counts)
        cases += 1
    with pytest.raises(ValueError, match="up to"):
        route(torch.zeros(4, 1, dtype=torch.long, device=device), 10**5)
    return cases


def check_weighted_gated(device: str) -> int:
    """``silu_weighted_gated`` and its backward against autograd through ``s[:, None] * silu(gate) * up`` in float64."""
    tk = _triton_module()
    g = torch.Generator().manual_seed(3)
    cases = 0
    # N: not a multiple of the rows per program, one row, none; F: a power of two, a partial chunk (12), several
    # chunks with a partial last one (600: chunks of 128), several full chunks (768: chunks of 256)
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding, within an ulp (the interpreter truncates)
        for N, F in [(37, 12), (21, 8), (1, 16), (0, 12), (5, 600), (3, 768)]:
            h = torch.randn(N, 2 * F, generator=g).to(device, dtype)
            s = torch.rand(N, generator=g).to(device)
            grad = torch.randn(N, F, generator=g).to(device, dtype)
            hr, sr = h.double().requires_grad_(), s.double().requires_grad_()
            gate, up = hr.chunk(2, dim=-1)
            want_a = sr[:, None] * torch.nn.functional.silu(gate) * up
            want_gh, want_gs = torch.autograd.grad(want_a, (hr, sr), grad.double())

            a = tk.silu_weighted_gated(h, s)
            assert a.dtype == dtype and a.shape == (N, F)
            torch.testing.assert_close(a.double(), want_a.detach(), rtol=tol, atol=1e-5)
            gh, gs, a2 = tk.silu_weighted_gated_backward(h, grad, s, True)
            assert gh.dtype == dtype and gh.shape == (N, 2 * F) and gs.dtype == torch.float32 and gs.shape == (N,)
            torch.testing.assert_close(gh.double(), want_gh, rtol=tol, atol=1e-5)
            # the row sum in float32 of the same (rounded) inputs: float32 accuracy, whatever h's dtype
            torch.testing.assert_close(gs.double(), want_gs, rtol=1e-5, atol=1e-5)
            assert torch.equal(a2, a)  # the forward's output recomputed: the same bits
            # without a: the same gradients
            gh3, gs3, none = tk.silu_weighted_gated_backward(h, grad.t().contiguous().t(), s, False)
            assert none is None and torch.equal(gh3, gh) and torch.equal(gs3, gs)
            cases += 1
    return cases


def check_weighted_bad_shapes() -> None:
    tk = _triton_module()
    with pytest.raises(ValueError, match="2F"):
        tk.silu_weighted_gated(torch.zeros(6, 5), torch.zeros(6))
    with pytest.raises(ValueError, match="weights"):
        tk.silu_weighted_gated(torch.zeros(6, 4), torch.zeros(6, 1))
    with pytest.raises(ValueError, match="weights"):
        tk.silu_weighted_gated_backward(torch.zeros(6, 4), torch.zeros(6, 2), torch.zeros(5), True)
    with pytest.raises(ValueError, match="grad has shape"):
        tk.silu_weighted_gated_backward(torch.zeros(6, 4), torch.zeros(6, 4), torch.zeros(6), False)


CASES = [(dtype, D) for dtype in (torch.float32, torch.bfloat16) for D in (200, 1536)]  # D: a partial block, several


def test_kernels_match_eager_in_the_interpreter():
    # triton decides interpreted or compiled when it is first imported: a fresh process with TRITON_INTERPRET=1
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked 4 cases, 8 routes, 12 weighted cases" in run.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_silu_weighted_gated_on_cuda():
    assert check_weighted_gated("cuda") == 12
    check_weighted_bad_shapes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,D", CASES)
def test_kernels_match_eager_on_cuda(dtype, D):
    check_kernels("cuda", dtype, D)
    check_bad_shapes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_route_matches_sort_on_cuda():
    assert check_route("cuda") == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels replace the compiled ones on CUDA only")
def test_triton_tier_on_cuda():
    triton, compiled = k.kernels_for("triton"), k.kernels_for("compiled")
    assert triton.tier == "triton" and triton.weighted_gated.__wrapped__ is compiled.weighted_gated
    assert triton.gated.__wrapped__ is compiled.gated and triton.expand_rows.__wrapped__ is k.expand_rows
    assert triton.route.__wrapped__ is k.route


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels replace the compiled ones on CUDA only")
@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
def test_routed_experts_with_triton_kernels_match_compiled(gemm):
    torch.manual_seed(0)
    T, K, E, D, F = 300, 8, 16, 256, 128
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    w1 = (torch.randn(E, 2 * F, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(E, D, F, device="cuda") / F**0.5).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    def run(kernels):
        weights, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        y = routed_experts(x, ids, weights, w1, w2, num_experts=E, options=EPOptions(kernels=kernels, gemm=gemm))
        return [t.clone().float() for t in (y, *torch.autograd.grad(y, (x, logits, w1, w2), gy))]

    got, want = run("triton"), run("compiled")
    for name, a, b in zip(("y", "grad x", "grad logits", "grad w_gate_up", "grad w_down"), got, want):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2 * scale, msg=lambda m, n=name: f"{n}: {m}")


if __name__ == "__main__":  # the interpreter run of test_kernels_match_eager_in_the_interpreter
    interpreter_numpy_fix()
    for dtype, D in CASES:
        check_kernels("cpu", dtype, D)
    check_bad_shapes()
    routes = check_route("cpu")
    check_weighted_bad_shapes()
    print(f"checked {len(CASES)} cases, {routes} routes, {check_weighted_gated('cpu')} weighted cases")


def test_kernels_compile_for_hopper():
    """Every kernel here compiles for sm_90 without a GPU (the interpreter checks values, not the lowering)."""
    tk = _triton_module()
    bf, i64, f32 = (torch.empty(0, dtype=d, device="meta") for d in (torch.bfloat16, torch.int64, torch.float32))
    from moeshard.ep.testing import compile_for_hopper

    kernels = [
        compile_for_hopper(tk._expand_rows_kernel, bf, i64, bf, D=2048, K=8, BLOCK_D=1024),
        compile_for_hopper(tk._gather_sum_kernel, bf, i64, bf, D=2048, K=8, BLOCK_D=1024),
        compile_for_hopper(tk._silu_gated_kernel, bf, bf, 1 << 20, F=768, BLOCK=1024),
        compile_for_hopper(tk._silu_gated_backward_kernel, bf, bf, bf, 1 << 20, F=768, BLOCK=1024),
        compile_for_hopper(tk._silu_weighted_gated_kernel, bf, f32, bf, 1 << 20, F=768, BLOCK=1024),
        *(
            compile_for_hopper(
                tk._silu_weighted_gated_backward_kernel,
                bf,
                bf,
                f32,
                bf,
                f32,
                bf,
                1 << 17,
                F=768,
                BLOCK_R=4,
                BLOCK_F=1024,
                NEED_A=need_a,
                num_warps=8,
            )  # fmt: skip
            for need_a in (False, True)
        ),
    ]
    from moeshard.ep import _route_triton as rt

    i32 = torch.empty(0, dtype=torch.int32, device="meta")
    kernels += [
        compile_for_hopper(rt._count_kernel, i64, i32, 1 << 17, E=128, BLOCK=rt._BLOCK),
        *(
            compile_for_hopper(
                rt._scan_kernel, i32, i64, i32, 2048, E=e, TILE_E=rt.scan_tile(e), ROWS=rt._SCAN_TILE // rt.scan_tile(e)
            )
            for e in (128, 8192)
        ),
        compile_for_hopper(rt._place_kernel, i64, i32, i32, i64, i64, 1 << 17, E=128, BLOCK=rt._BLOCK),
    ]
    # the experts' weight gradients, four parts summed, written with their squares: by pointers, and by TMA (the
    # kernel Hopper runs: its output through a host descriptor)
    from moeshard.ep import _wgrad_triton as wg

    parts = [bf, bf, i32, 1536, 2048] * wg.MAX_PARTS
    for tma, configs in ((False, wg.CONFIGS), (True, wg.TMA_CONFIGS)):
        for cfg in configs.values():
            tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_K", "BLOCK_R")}
            out_desc = f"tensordesc<bf16[1,{cfg['BLOCK_M']},{cfg['BLOCK_K']}]>" if tma else bf
            kernels.append(
                compile_for_hopper(
                    wg._wgrad_parts_kernel,
                    *parts,
                    bf,
                    out_desc,
                    f32,
                    1536,
                    2048,
                    1.0,
                    PARTS=wg.MAX_PARTS,
                    ACCUMULATE=True,
                    TMA=tma,
                    PRECISION="tf32",
                    SQUARES=True,
                    num_warps=cfg["num_warps"],
                    **tiles,
                )  # fmt: skip
            )
    assert all(k.asm["cubin"] for k in kernels)
