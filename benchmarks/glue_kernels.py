"""The step's small kernels this round replaced, each against what it replaced, alone on one GPU.

    source benchmarks/gpu_env.sh && python3 benchmarks/glue_kernels.py [--tokens 16384] [--layers 8]

ms per call (``do_bench`` median), each pair checked for the same result first:

- the routers' top-k at one layer's shape (``[tokens, 128]`` float32): ``torch.topk`` against ``row_topk`` with the
  kernel's op (the Triton selection's ids, the values gathered; eagerly, so with the op's Python launch); the same
  values and ids per row;
- the load-balancing loss's counts over all layers' rows (``[layers x tokens, 128]`` bf16 probabilities, top-8):
  ``torch.topk`` and a scatter into 128 bins against ``topk_counts``; the same counts;
- the route's scan (``[tokens x 8 / 64, 128]`` histogram): the one-program scan of ep 0.4.5 (the shipped kernel with
  one tile of all experts) against the shipped tiles; the same offsets, counts and first positions;
- the final norm (``[tokens, 2048]`` bf16), forward and backward: eager against ``torch.compile``.
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.testing import do_bench

from moeshard.ep import _route_triton
from moeshard.models.common._layers import RMSNorm
from moeshard.models.common._topk import row_topk
from moeshard.models.common._topk_triton import topk_counts, topk_ids_op


def scans(hist: torch.Tensor) -> dict:
    """The shipped scan in tiles of experts, and ep 0.4.5's one program over all experts: the same kernel with one
    tile as wide as the experts (its first positions then come from that tile alone, as ep 0.4.5 stored them)."""
    nb, e = hist.shape

    def launch(tile: int):
        def run():
            z = torch.zeros(nb * e + e, dtype=torch.int32, device=hist.device)
            h, first = z[: nb * e].view(nb, e), z[nb * e :]
            h.copy_(hist)
            counts = torch.empty(e, dtype=torch.int64, device=hist.device)
            _route_triton._scan_kernel[(triton.cdiv(e, tile),)](
                h, counts, first, nb, E=e, TILE_E=tile, ROWS=_route_triton._SCAN_TILE // tile
            )
            return h, counts, first

        return run

    return {"one program (ep 0.4.5)": launch(e), "tiles (shipped)": launch(_route_triton.scan_tile(e))}


def timed(name: str, fns: dict, same) -> None:
    results = [fn() for fn in fns.values()]
    for r in results[1:]:
        assert same(results[0], r), f"{name}: the forms differ"
    line = ", ".join(f"{form} {do_bench(fn, warmup=25, rep=200):.3f} ms" for form, fn in fns.items())
    print(f"{name}: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    T, L, E, K, dev = args.tokens, args.layers, 128, 8, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(T, E, device=dev, generator=g) * 0.02).bfloat16()
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    timed(
        "routers' top-k, one layer",
        {"torch.topk": lambda: torch.topk(probs, K, dim=-1), "row_topk": lambda: row_topk(probs, K, topk_ids_op)},
        lambda a, b: torch.equal(a[0], b[0]) and torch.equal(a[1].sort(-1).values, b[1].sort(-1).values),
    )
    all_probs = torch.softmax((torch.randn(L * T, E, device=dev, generator=g) * 0.02).bfloat16(), dim=-1)
    ones = torch.ones(L * T, device=dev)

    def plain_counts():
        ids = torch.topk(all_probs, K, dim=-1)[1]
        return torch.zeros(E, device=dev).scatter_add_(0, ids.reshape(-1), ones.repeat_interleave(K))

    timed(
        "balancing loss's counts, all layers",
        {"torch.topk + scatter": plain_counts, "topk_counts": lambda: topk_counts(all_probs, ones, K)},
        torch.equal,
    )
    ids = torch.topk(probs, K, dim=-1)[1].reshape(-1)
    nb = triton.cdiv(ids.numel(), _route_triton._BLOCK)
    hist = torch.zeros(nb, E, dtype=torch.int32, device=dev)
    _route_triton._count_kernel[(nb,)](ids, hist, ids.numel(), E=E, BLOCK=_route_triton._BLOCK)
    timed("route's scan, one layer", scans(hist), lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b)))
    norm = RMSNorm(2048, 1e-6).to(dev, torch.bfloat16)
    compiled = torch.compile(norm.forward)
    x = torch.randn(T, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step(fn):
        def run():
            x.grad = norm.weight.grad = None
            fn(x).backward(grad)
            return x.grad, norm.weight.grad

        return run

    timed(
        "final norm, forward + backward",
        {"eager": step(norm.forward), "compiled": step(compiled)},
        # bf16 results of different reduction orders (the weight's gradient sums 16,384 rows): equal to a relative
        # norm of the difference, not elementwise
        lambda a, b: all(((p.float() - q.float()).norm() / q.float().norm()).item() < 1e-2 for p, q in zip(a, b)),
    )


if __name__ == "__main__":
    main()
