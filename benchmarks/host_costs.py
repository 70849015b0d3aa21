"""Host time per call of the pieces of one MoE layer at micro-batch 1 (one GPU, 30B-A3B expert shapes).

    source benchmarks/gpu_env.sh; python3 benchmarks/host_costs.py [--tokens 4096] [--calls 50]

Each piece is called ``--calls`` times back to back after a warm-up and a synchronisation; the figure is the host
time of the loop per call (``time.perf_counter``), no profiler, no sync inside the loop (the launch queue holds
far more than one loop's launches, so no call waits for the GPU). What it answers: what a launch of each kernel
costs the host, next to an aten op's, where the micro-batch-1 step is paced by the host.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _noop(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def host_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * t / calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    from moeshard.ep import _route_triton, _triton
    from moeshard.ep._mlp import grouped_expert_mlp
    from moeshard.ep._wgrad_triton import grouped_weight_grad

    dev, bf = torch.device("cuda"), torch.bfloat16
    T, K, E, D, Fd = args.tokens, 8, 128, 2048, 768
    N = T * K
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int64)
    s = torch.rand(T * K, device=dev)
    x = torch.randn(T, D, device=dev, dtype=bf)
    order, inv, counts = _route_triton.route(ids, E)
    offs = counts.cumsum(0).to(torch.int32)
    xs = _triton.expand_rows(x, order, inv, K)
    h = torch.randn(N, 2 * Fd, device=dev, dtype=bf)
    a = _triton.gated(h)
    y = torch.randn(N, D, device=dev, dtype=bf)
    w1 = torch.randn(E, 2 * Fd, D, device=dev, dtype=bf) * 0.02
    w2 = torch.randn(E, D, Fd, device=dev, dtype=bf) * 0.02
    gw1 = torch.zeros_like(w1)
    small = torch.zeros(1024, device=dev)
    W = torch.randn(4096, D, device=dev, dtype=bf)
    w1g, w2g = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xg = xs.clone().requires_grad_()

    # FSDP2's reduce-scatter input for one attention unit at world 1: its float32 gradients, one chunk
    shapes = [(4096, D), (512, D), (512, D), (D, 4096), (128,), (128,), (D,), (D,), (E, D)]
    unit_grads = [torch.randn(s, device=dev) for s in shapes]
    rs_input = torch.empty(sum(g.numel() for g in unit_grads), device=dev)

    def mlp_fwd_bwd():
        out = grouped_expert_mlp(xg, counts, w1g, w2g, kernels="triton")
        out.backward(y)

    pieces = {
        "torch.empty (int64, N)": lambda: torch.empty(N, dtype=torch.int64, device=dev),
        "torch.zeros (int32, [N/64, E])": lambda: torch.zeros((N // 64, E), dtype=torch.int32, device=dev),
        "aten add_ (1 K floats)": lambda: small.add_(1.0),
        "aten mm [T, D] x [D, 4096] (F.linear)": lambda: F.linear(x, W),
        "F.grouped_mm gate/up forward": lambda: F.grouped_mm(xs, w1.transpose(-2, -1), offs=offs),
        "F.grouped_mm weight grad (writes)": lambda: F.grouped_mm(h.transpose(0, 1), xs, offs=offs),
        "triton no-op kernel, 3 args": lambda: _noop[(1,)](small, 1024, BLOCK=1024),
        "route (3 triton kernels + 5 allocations)": lambda: _route_triton.route(ids, E),
        "expand_rows (triton)": lambda: _triton.expand_rows(x, order, inv, K),
        "gated SwiGLU (triton)": lambda: _triton.gated(h),
        "SwiGLU backward (triton)": lambda: _triton.silu_gated_backward(h, a),
        "weighted SwiGLU (triton)": lambda: _triton.silu_weighted_gated(h, s),
        "weighted SwiGLU backward (triton)": lambda: _triton.silu_weighted_gated_backward(h, a, s, False),
        "gather_sum (triton)": lambda: _triton.gather_sum(y, inv, K),
        "weight grad, TMA kernel, accumulating": lambda: grouped_weight_grad(h, xs, offs, gw1, accumulate=True),
        "weight grad, pointer kernel, accumulating": lambda: grouped_weight_grad(
            h, xs, offs, gw1, accumulate=True, tma=False
        ),
        "expert MLP forward + backward (autograd)": mlp_fwd_bwd,
        "torch._chunk_cat, one attention unit's 9 float32 gradients": lambda: torch._chunk_cat(
            unit_grads, dim=0, num_chunks=1, out=rs_input.view(1, -1)
        ),
    }
    print(f"host us per call, {T} tokens x top-{K}, {E} experts, D {D}, F {Fd}, {args.calls} calls each")
    for name, fn in pieces.items():
        print(f"  {host_us(fn, args.calls):8.1f}  {name}")


if __name__ == "__main__":
    main()
