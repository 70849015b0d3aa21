"""The experts' weight gradients of a step's micro-batches, formed per micro-batch or once from their kept factors.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_parts.py
    MICRO_BATCHES="4 2" python3 benchmarks/wgrad_parts.py   # some step splits only

128 experts, top-8 of random scores, 16,384 tokens per step in 1, 2 or 4 micro-batches; gate/up ``[E, 1536, 2048]``
(``a`` = the gate/up output's gradient, ``b`` = the input rows) and down ``[E, 2048, 768]`` (``a`` = the output's
gradient, ``b`` = the gated activation). Per step and weight, ms (``do_bench`` median):

- ``per micro-batch``: what the expert pass does without kept factors: the first micro-batch's gradient written by
  torch's ``grouped_mm``, each later one added in by ``grouped_weight_grad(accumulate=True)``;
- ``parts <tile>``: ``grouped_weight_grad_parts`` over every micro-batch's factors at once (written once), by tile.

Each schedule is checked against the sum of each part's ``grouped_mm`` in float32 before it is timed (relative
error printed; bf16 rounding is ~2e-3).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton.testing

from moeshard.ep._wgrad_triton import TMA_CONFIGS, grouped_weight_grad, grouped_weight_grad_parts

E, TOPK, TOKENS = 128, 8, 16384
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
TILES = {  # (BLOCK_M, BLOCK_K, BLOCK_R, num_warps, num_stages)
    "128x128x32 w4 s4": (128, 128, 32, 4, 4),
    "128x128x32 w4 s3": (128, 128, 32, 4, 3),
    "128x128x32 w4 s5": (128, 128, 32, 4, 5),
    "128x128x32 w4 s6": (128, 128, 32, 4, 6),
    "128x128x32 w8 s4": (128, 128, 32, 8, 4),
    "128x128x16 w4 s6": (128, 128, 16, 4, 6),
    "64x256x32 w4 s4": (64, 256, 32, 4, 4),
    "256x128x32 w8 s3": (256, 128, 32, 8, 3),
    "128x128x64 w4 s3": (128, 128, 64, 4, 3),
    "128x256x64 w8 s3": (128, 256, 64, 8, 3),
}


def _parts(micro_batches: int, M: int, K: int, g: torch.Generator):
    parts = []
    for _ in range(micro_batches):
        T = TOKENS // micro_batches
        ids = torch.randn(T, E, generator=g).topk(TOPK, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        N = T * TOPK
        a = (torch.randn(N, M, generator=g) / 8).to("cuda", torch.bfloat16)
        b = (torch.randn(N, K, generator=g) / 8).to("cuda", torch.bfloat16)
        parts.append((a, b, offs))
    return parts


def _reference(parts, M, K):
    out = torch.zeros(E, M, K, device="cuda", dtype=torch.float32)
    for a, b, offs in parts:
        out += F.grouped_mm(a.transpose(0, 1), b, offs=offs).float()  # each part rounded to bf16 once
    return out


def _per_micro_batch(parts, out):
    a, b, offs = parts[0]
    out.copy_(F.grouped_mm(a.transpose(0, 1), b, offs=offs))  # what autograd stores (a new tensor; copy for timing)
    for a, b, offs in parts[1:]:
        grouped_weight_grad(a, b, offs, out, accumulate=True)


def _per_micro_batch_time(parts, out):
    a, b, offs = parts[0]

    def run():
        F.grouped_mm(a.transpose(0, 1), b, offs=offs)
        for a2, b2, o2 in parts[1:]:
            grouped_weight_grad(a2, b2, o2, out, accumulate=True)

    return triton.testing.do_bench(run, warmup=25, rep=200)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for name, tile in TILES.items():
        bm, bk, br, w, s = tile
        TMA_CONFIGS[name] = {"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_R": br, "num_warps": w, "num_stages": s}
    print(f"{'micro-batches':>13} {'weight':>8} {'schedule':>26} {'ms':>7} {'rel err':>8}")
    for micro_batches in [int(m) for m in os.environ.get("MICRO_BATCHES", "4 2 1").split()]:
        for wname, (M, K) in SHAPES.items():
            parts = _parts(micro_batches, M, K, g)
            ref = _reference(parts, M, K)
            out = torch.empty(E, M, K, device="cuda", dtype=torch.bfloat16)
            _per_micro_batch(parts, out)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms = _per_micro_batch_time(parts, out)
            print(f"{micro_batches:>13} {wname:>8} {'per micro-batch':>26} {ms:7.3f} {err:8.1e}")
            if micro_batches == 1:
                continue
            for tname in ["auto", *TILES]:
                config = None if tname == "auto" else tname
                out.fill_(float("nan"))
                grouped_weight_grad_parts(parts, out, accumulate=False, config=config)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = triton.testing.do_bench(
                    lambda c=config, p=parts, o=out: grouped_weight_grad_parts(p, o, accumulate=False, config=c),
                    warmup=25,
                    rep=200,
                )
                print(f"{micro_batches:>13} {wname:>8} {'parts ' + tname:>26} {ms:7.3f} {err:8.1e}")


if __name__ == "__main__":
    main()
