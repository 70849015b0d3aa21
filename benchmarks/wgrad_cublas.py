"""The experts' accumulating weight gradient by cuBLAS: each expert's rows copied into a padded ``[E, cap, ·]``
buffer, then one batched ``baddbmm_`` (beta = 1) adds ``a_e^T b_e`` into the held gradient, against
``moeshard.ep._wgrad_triton``'s accumulating kernel and ``grouped_mm`` + a separate add.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_cublas.py [--tokens 4096,8192,16384]

Same shapes, routing and float32 reference as ``benchmarks/wgrad_gemm.py``. ``cap`` is the largest expert's rows
rounded up to 8 (read on the host here; a trainer would need it without a sync). The pad variant includes zeroing
the buffers and the row scatter; the destination index is built once per micro-batch and shared by both weights,
so it is timed apart. Prints ms, TFLOP/s of the useful work, and the error against float32.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton.testing
from wgrad_gemm import SHAPES, E, _reference, _rel, _rows

from moeshard.ep._wgrad_triton import grouped_weight_grad


def _dest(offs: torch.Tensor, N: int, cap: int) -> torch.Tensor:
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    expert = torch.repeat_interleave(torch.arange(E, device=offs.device), counts, output_size=N)
    starts = (offs.long() - counts)[expert]
    return expert * cap + torch.arange(N, device=offs.device) - starts


def _time_shape(tokens: int, M: int, K: int, dev) -> list[tuple[str, float, float, float, int]]:
    """``(variant, ms, TFLOP/s, rel err, cap)`` of each variant at one shape."""
    N = tokens * 8
    offs = _rows(tokens, dev)
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    cap = -(-int(counts.max()) // 8) * 8
    a = torch.randn(N, M, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    ref = _reference(a, b, offs)
    old = torch.randn(E, M, K, device=dev, dtype=torch.bfloat16)
    dest = _dest(offs, N, cap)
    ap = torch.zeros(E * cap, M, device=dev, dtype=torch.bfloat16)
    bp = torch.zeros(E * cap, K, device=dev, dtype=torch.bfloat16)

    def pad():
        ap.zero_()
        bp.zero_()
        ap.index_copy_(0, dest, a)
        bp.index_copy_(0, dest, b)

    def bmm(acc):
        acc.baddbmm_(ap.view(E, cap, M).transpose(1, 2), bp.view(E, cap, K))

    def pad_bmm(acc):
        pad()
        bmm(acc)

    pad()
    checks = {}
    for label, fn in (
        ("triton +=", lambda acc: grouped_weight_grad(a, b, offs, acc, accumulate=True)),
        ("grouped_mm + add", lambda acc: acc.add_(F.grouped_mm(a.T, b, offs=offs))),
        ("pad + baddbmm +=", pad_bmm),
    ):
        acc = old.clone()
        fn(acc)
        checks[label] = _rel(acc, old.float() + ref)
    grad = old.clone()
    variants = [
        ("grouped_mm (write)", lambda: F.grouped_mm(a.T, b, offs=offs), _rel(F.grouped_mm(a.T, b, offs=offs), ref)),
        ("triton +=", lambda: grouped_weight_grad(a, b, offs, grad, accumulate=True), checks["triton +="]),
        ("grouped_mm + add", lambda: grad.add_(F.grouped_mm(a.T, b, offs=offs)), checks["grouped_mm + add"]),
        ("pad + baddbmm +=", lambda: pad_bmm(grad), checks["pad + baddbmm +="]),
        ("baddbmm += (padded given)", lambda: bmm(grad), checks["pad + baddbmm +="]),
        ("pad only", pad, 0.0),
        ("dest index", lambda: _dest(offs, N, cap), 0.0),
    ]
    rows = []
    for label, fn, err in variants:
        ms = triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median")
        rows.append((label, ms, 2 * N * M * K / ms / 1e9, err, cap))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch (rows = tokens x 8)")
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{'tokens':>6} {'weight':>7} {'variant':<28} {'ms':>7} {'TFLOP/s':>8} {'rel err':>8}")
    for tokens, (wname, (M, K)) in itertools.product(map(int, args.tokens.split(",")), SHAPES.items()):
        for label, ms, tf, err, cap in _time_shape(tokens, M, K, dev):
            print(f"{tokens:>6} {wname:>7} {label:<28} {ms:7.3f} {tf:8.1f} {err:8.1e}  cap={cap}")


if __name__ == "__main__":
    main()
