"""The experts' weight-gradient grouped GEMM on one GPU: torch's ``grouped_mm`` (+ the separate accumulate pass)
against ``moeshard.ep``'s Triton kernel writing or adding into the gradient, at Qwen3-30B-A3B's expert shapes.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_gemm.py [--configs a,b] [--tokens 4096,16384]

128 local experts, top-8 routing of random scores (so the rows per expert are uneven, as in training); the two
weight gradients of one layer: gate/up ``[E, 1536, 2048]`` from ``gh [N, 1536]`` and ``x [N, 2048]``, down
``[E, 2048, 768]`` from ``grad [N, 2048]`` and ``a [N, 768]``. Each variant is checked against a float32
reference before it is timed (``triton.testing.do_bench``, median); poisoned outputs catch unwritten tiles.
Prints one table: ms, TFLOP/s and the bytes the variant must move at least (inputs once, the gradient written, and
read too where it accumulates).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
import triton.testing

from moeshard.ep._wgrad_triton import CONFIGS, grouped_weight_grad

E, TOPK = 128, 8
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
SWEEP = {
    "m128k128r64w8s3": (128, 128, 64, 8, 3),
    "m128k128r64w4s4": (128, 128, 64, 4, 4),
    "m128k128r32w4s4": (128, 128, 32, 4, 4),
    "m128k256r64w8s3": (128, 256, 64, 8, 3),
    "m256k128r64w8s3": (256, 128, 64, 8, 3),
    "m64k128r64w4s4": (64, 128, 64, 4, 4),
    "m128k128r128w8s2": (128, 128, 128, 8, 2),
    "m128k64r64w4s4": (128, 64, 64, 4, 4),
    "m128k256r32w8s4": (128, 256, 32, 8, 4),
    "m128k256r64w8s4": (128, 256, 64, 8, 4),
    "m256k128r32w8s4": (256, 128, 32, 8, 4),
    "m128k128r32w8s4": (128, 128, 32, 8, 4),
    "m128k256r32w4s3": (128, 256, 32, 4, 3),
}


def _rows(tokens: int, device) -> torch.Tensor:
    ids = torch.rand(tokens, E, device=device).topk(TOPK, dim=1).indices
    return torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(torch.int32)


def _reference(a, b, offs):
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([a[s:e].float().T @ b[s:e].float() for s, e in zip(starts, ends)])


def _rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


def _time_shape(tokens: int, M: int, K: int, configs: list[str], dev) -> list[tuple]:
    """``(variant, ms, TFLOP/s, min GB/s, rel err)`` of each variant at one shape."""
    N = tokens * TOPK
    offs = _rows(tokens, dev)
    a = torch.randn(N, M, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    ref = _reference(a, b, offs)
    old = torch.randn(E, M, K, device=dev, dtype=torch.bfloat16)
    gb_in, gb_out = (a.numel() + b.numel()) * 2 / 1e9, E * M * K * 2 / 1e9
    grad = old.clone()
    variants = [
        ("grouped_mm", lambda: F.grouped_mm(a.T, b, offs=offs), _rel(F.grouped_mm(a.T, b, offs=offs), ref), gb_out),
        # the gradient so far read, the GEMM's output written and read, the sum written
        ("grouped_mm + add", lambda: grad.add_(F.grouped_mm(a.T, b, offs=offs)), None, 3 * gb_out),
    ]
    for cfg in configs:
        out = torch.full((E, M, K), float("nan"), device=dev, dtype=torch.bfloat16)
        grouped_weight_grad(a, b, offs, out, accumulate=False, config=cfg)
        acc = old.clone()
        grouped_weight_grad(a, b, offs, acc, accumulate=True, config=cfg)
        variants += [
            (
                f"triton {cfg}",
                functools.partial(grouped_weight_grad, a, b, offs, out, accumulate=False, config=cfg),
                _rel(out, ref),
                gb_out,
            ),
            (
                f"triton {cfg} +=",
                functools.partial(grouped_weight_grad, a, b, offs, acc, accumulate=True, config=cfg),
                _rel(acc, old.float() + ref),
                2 * gb_out,
            ),
        ]
    rows = []
    for label, fn, err, gb in variants:
        ms = triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median")
        rows.append(
            (label, ms, 2 * N * M * K / ms / 1e9, (gb_in + gb) / ms * 1e3, variants[0][2] if err is None else err)
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch (rows = tokens x 8)")
    p.add_argument("--configs", default=",".join(SWEEP), help="tile configs to time: " + ",".join(SWEEP))
    args = p.parse_args()
    for name, (bm, bk, br, w, s) in SWEEP.items():
        CONFIGS[name] = {"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_R": br, "num_warps": w, "num_stages": s}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{'tokens':>6} {'weight':>7} {'variant':<32} {'ms':>7} {'TFLOP/s':>8} {'min GB/s':>8} {'rel err':>8}")
    for tokens, (wname, (M, K)) in itertools.product(map(int, args.tokens.split(",")), SHAPES.items()):
        for label, ms, tf, gbs, e in _time_shape(tokens, M, K, args.configs.split(","), dev):
            print(f"{tokens:>6} {wname:>7} {label:<32} {ms:7.3f} {tf:8.1f} {gbs:8.0f} {e:8.1e}")


if __name__ == "__main__":
    main()
