"""Two variants of ``moeshard.ep._wgrad_triton``'s accumulating kernel, timed against it at few rows per expert.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_variants.py

- ``early``: the old gradient tile is loaded before the row loop, so its latency hides behind the GEMM;
- ``persistent``: one program per SM slot walks the tiles (``tl.range(..., flatten=True)``, Triton's persistent
  matmul on Hopper), so a tile's epilogue overlaps the next tile's loads.
Same shapes and checks as ``benchmarks/wgrad_gemm.py`` (float32 reference, poisoned outputs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.testing

from moeshard.ep._wgrad_triton import grouped_weight_grad

E, TOPK = 128, 8


@triton.jit
def _early(
    a_ptr, b_ptr, out_ptr, offs_ptr, M, K, sa, sb, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pm, pk = pid // tiles_k, pid % tiles_k
    end = tl.load(offs_ptr + e).to(tl.int64)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int64), 0)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    out = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
    old = tl.load(out)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        mr = rr < end
        a = tl.load(a_ptr + rr[:, None] * sa + rm[None, :], mask=mr[:, None], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * sb + rk[None, :], mask=mr[:, None], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    tl.store(out, (acc + old.to(tl.float32)).to(out_ptr.dtype.element_ty))


@triton.jit
def _persistent(
    a_ptr,
    b_ptr,
    out_ptr,
    offs_ptr,
    M,
    K,
    sa,
    sb,
    n_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NUM_PROGS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_expert = tl.cdiv(M, BLOCK_M) * tiles_k
    for tile in tl.range(tl.program_id(0), per_expert * n_experts, NUM_PROGS, flatten=FLATTEN):
        e = tile // per_expert
        t = tile % per_expert
        pm, pk = t // tiles_k, t % tiles_k
        end = tl.load(offs_ptr + e).to(tl.int64)
        start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int64), 0)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            mr = rr < end
            a = tl.load(a_ptr + rr[:, None] * sa + rm[None, :], mask=mr[:, None], other=0.0)
            b = tl.load(b_ptr + rr[:, None] * sb + rk[None, :], mask=mr[:, None], other=0.0)
            acc = tl.dot(tl.trans(a), b, acc)
        out = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
        tl.store(out, (acc + tl.load(out).to(tl.float32)).to(out_ptr.dtype.element_ty))


def _variants(a, b, offs, M, K, sms):
    """Name -> ``fn(out)`` adding ``a[rows_e]^T @ b[rows_e]`` into ``out``."""
    runs = {}
    for name in ("few_rows", "many_rows"):
        runs[f"current {name}"] = functools.partial(_current, a, b, offs, config=name)
    for bm, bk, br, w, s in ((128, 128, 32, 8, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)):
        grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk), E)
        kw = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, num_warps=w, num_stages=s)
        runs[f"early {bm}x{bk}x{br} w{w} s{s}"] = functools.partial(_launch, _early[grid], a, b, offs, (), kw)
    for bm, bk, br, w, s, per_sm, flat in (
        (128, 128, 32, 4, 4, 2, True),
        (128, 128, 32, 4, 4, 2, False),
        (128, 128, 64, 8, 3, 1, True),
        (128, 256, 64, 8, 3, 1, True),
    ):
        kw = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, NUM_PROGS=sms * per_sm, FLATTEN=flat, num_warps=w, num_stages=s)
        name = f"persistent {bm}x{bk}x{br} w{w} s{s} x{per_sm} f{int(flat)}"
        runs[name] = functools.partial(_launch, _persistent[(sms * per_sm,)], a, b, offs, (E,), kw)
    return runs


def _current(a, b, offs, out, *, config):
    grouped_weight_grad(a, b, offs, out, accumulate=True, config=config)


def _launch(kernel, a, b, offs, extra, kw, out):
    M, K = a.shape[1], b.shape[1]
    kernel(a, b, out, offs, M, K, a.stride(0), b.stride(0), *extra, **kw)


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{'tokens':>6} {'M':>5} {'K':>5} {'variant':<40} {'ms':>7} {'rel err':>8}")
    for tokens in (4096, 8192):
        for M, K in ((1536, 2048), (2048, 768)):
            N = tokens * TOPK
            ids = torch.rand(tokens, E, device=dev).topk(TOPK, dim=1).indices
            offs = torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(torch.int32)
            a = torch.randn(N, M, device=dev, dtype=torch.bfloat16)
            b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
            ends = offs.tolist()
            ref = torch.stack([a[s:e].float().T @ b[s:e].float() for s, e in zip([0, *ends[:-1]], ends)])
            old = torch.randn(E, M, K, device=dev, dtype=torch.bfloat16)
            want = old.float() + ref
            for name, fn in _variants(a, b, offs, M, K, sms).items():
                try:
                    o = old.clone()
                    fn(o)
                    err = ((o.float() - want).norm() / want.norm()).item()
                    ms = triton.testing.do_bench(
                        functools.partial(fn, old.clone()), warmup=20, rep=80, return_mode="median"
                    )
                    print(f"{tokens:>6} {M:>5} {K:>5} {name:<40} {ms:7.3f} {err:8.1e}")
                except Exception as ex:  # a variant that does not compile: say so, go on
                    print(f"{tokens:>6} {M:>5} {K:>5} {name:<40} failed: {type(ex).__name__}: {str(ex)[:120]}")


if __name__ == "__main__":
    main()
