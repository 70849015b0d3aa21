"""The row expansion before the experts' first GEMM (and in the combine's backward), per layer: each token's row
once per routed copy, in expert order, ``[T*K, D]``.

    source benchmarks/gpu_env.sh && python3 benchmarks/expand_rows.py [--tokens 16384]

Two forms, ms (``do_bench`` median) and the bandwidth of the bytes each must move:

- ``per copy``: a program per copy ``n`` reads row ``order[n] // K`` (ep 0.4.4's kernel, kept here to compare). A
  token's K copies sit in K experts' stretches of the output, far apart in time, so at T·D beyond the L2 cache
  each copy reads its row from memory again: 2·N·D element moves.
- ``per token`` (the shipped ``moeshard.ep._triton.expand_rows``): a program per token reads its row once and
  writes it to its K copies' places ``inv[t*K+k]``: (T + N)·D.

Both are checked against ``x[order // K]`` before they are timed.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moeshard.ep import _route_triton, _triton


@triton.jit
def _per_copy_kernel(x_ptr, order_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    t = tl.load(order_ptr + n).to(tl.int64) // K
    tl.store(out_ptr + n * D + offs, tl.load(x_ptr + t * D + offs, mask=mask), mask=mask)


def per_copy(x, order, K, block_d=1024):
    N, D = order.numel(), x.shape[1]
    out = torch.empty((N, D), dtype=x.dtype, device=x.device)
    _per_copy_kernel[(N, triton.cdiv(D, block_d))](x, order, out, D, K=K, BLOCK_D=block_d)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    T, K, E, D = args.tokens, 8, 128, args.hidden
    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    order, inv, _ = _route_triton.route(ids, E)
    x = torch.randn(T, D, device=dev, dtype=bf)
    want = x[order // K]
    forms = {
        "per copy (ep 0.4.4)": (lambda: per_copy(x, order, K), 2 * T * K * D * 2),
        "per token (shipped)": (lambda: _triton.expand_rows(x, order, inv, K), (T + T * K) * D * 2),
    }
    print(f"T={T} K={K} E={E} D={D}: x {T * D * 2 / 1e6:.0f} MB, copies {T * K * D * 2 / 1e6:.0f} MB")
    for name, (fn, nbytes) in forms.items():
        assert torch.equal(fn(), want), name
        ms = do_bench(fn, warmup=50, rep=300)
        print(f"  {name:22s} {ms:.4f} ms  {nbytes / ms / 1e9:.2f} TB/s of its own bytes")


if __name__ == "__main__":
    main()
