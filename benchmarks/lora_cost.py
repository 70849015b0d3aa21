"""The adapter's own cost: forward + backward of one MoE layer's frozen expert GEMMs and of its attention
projections, each without and with LoRA adapters (rank 16 by default), on one device.

    python3 benchmarks/lora_cost.py                      # the 30B-A3B geometry, 8192 tokens, all 128 experts (GPU)
    python3 benchmarks/lora_cost.py --experts 16         # one EP rank's share at EP 8
    python3 benchmarks/lora_cost.py --smoke              # a tiny geometry on CPU (seconds)

Experts: ``moeshard.ep.LocalDispatch`` (every expert local: route, grouped expert MLP, combine) over ``tokens``
tokens routed uniformly at random to ``top_k`` experts each, the base frozen
(no weight gradient), with and without a ``moeshard.ep.LowRankDelta`` on gate/up and down (float32 masters, cast
to the compute dtype, as a LoRA job holds them). Attention: the q, k, v, o projections as frozen linears, with and
without ``x Aᵀ Bᵀ`` beside each. Prints the median milliseconds of each and the adapters' share of the adapted time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from moeshard.ep import EPOptions, LocalDispatch, LowRankDelta
from moeshard.lora import LoraOptions, apply_lora


def _timed(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` (forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _adapter(E: int, out_f: int, in_f: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # B non-zero (a trained adapter): the kernels do the same work either way, the values only keep it honest
    A = (torch.randn(E, rank, in_f, device=device) / in_f**0.5).requires_grad_()
    B = (torch.randn(E, out_f, rank, device=device) * 0.01).requires_grad_()
    return A, B


def measure(args: argparse.Namespace) -> dict[str, float]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    D, Fw, E, T, K, r = args.hidden, args.expert_width, args.experts, args.tokens, args.top_k, args.rank
    s = args.alpha / r
    gen = torch.Generator().manual_seed(0)
    topk_ids = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K].to(device)  # K distinct experts per token
    topk_weights = torch.softmax(torch.randn(T, K, generator=gen), dim=-1).to(device)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    dispatch = LocalDispatch(E, EPOptions(gemm=args.gemm, kernels=args.kernels))
    w1 = torch.randn(E, 2 * Fw, D, device=device, dtype=dtype) / D**0.5  # frozen: no gradient
    w2 = torch.randn(E, D, Fw, device=device, dtype=dtype) / Fw**0.5
    A1, B1 = _adapter(E, 2 * Fw, D, r, device)
    A2, B2 = _adapter(E, D, Fw, r, device)

    def experts(with_lora: bool):
        def run():
            deltas = (LowRankDelta(A1, B1, s), LowRankDelta(A2, B2, s)) if with_lora else (None, None)
            y = dispatch(x, topk_ids, topk_weights, w1, w2, deltas=deltas)
            y.backward(torch.ones_like(y))

        return run

    H, G, hd = args.heads, args.kv_heads, args.head_dim
    shapes = {"q_proj": (H * hd, D), "k_proj": (G * hd, D), "v_proj": (G * hd, D), "o_proj": (D, H * hd)}
    h = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    attn_in = torch.randn(T, H * hd, device=device, dtype=dtype, requires_grad=True)

    def attention(with_lora: bool):
        # the projections as frozen linears; with LoRA, moeshard.lora's own adapters (the app's code path)
        proj = nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, (o, i) in shapes.items()}).to(device, dtype)
        proj.requires_grad_(False)
        if with_lora:
            apply_lora(proj, LoraOptions(rank=r, alpha=args.alpha, target_modules=tuple(shapes)), seed=0)
            with torch.no_grad():  # B non-zero (a trained adapter)
                for m in proj.values():
                    m.lora_B.normal_(0.0, 0.01)

        def run():
            outs = [proj[n](h) for n in ("q_proj", "k_proj", "v_proj")] + [proj["o_proj"](attn_in)]
            sum(o.float().sum() for o in outs).backward()

        return run

    t = {}
    for name, make in (("experts", experts), ("attention", attention)):
        for lora in (False, True):
            fn = make(lora)
            t[f"{name}{'_lora' if lora else ''}_ms"] = _timed(fn, args.iters, args.warmup, device)
            if args.profile:
                _profile(fn, f"{name}{' with adapters' if lora else ''}", device)
    return t


def _profile(fn, title: str, device: torch.device, rows: int = 14) -> None:
    """Print the kernels of three calls of ``fn`` by their total device time (where the adapters' time goes)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- {title}: 3 calls, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--expert-width", type=int, default=768)
    p.add_argument("--experts", type=int, default=128, help="local experts (128 / EP size)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--gemm", default="auto", help="the base GEMMs' backend (moeshard.ep.EPOptions.gemm)")
    p.add_argument("--kernels", default="eager", help="the gated activation's tier (moeshard.ep.EPOptions.kernels)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--smoke", action="store_true", help="a tiny geometry, 2 iterations (CPU check)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--profile", action="store_true", help="also print each variant's kernels by device time")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.expert_width, args.experts, args.heads, args.kv_heads, args.head_dim = 64, 32, 4, 4, 2, 16
        args.tokens, args.top_k, args.rank, args.iters, args.warmup = 64, 2, 8, 2, 1
    t = measure(args)
    for name in ("experts", "attention"):
        base, lora = t[f"{name}_ms"], t[f"{name}_lora_ms"]
        share = (lora - base) / lora if lora > 0 else 0.0
        t[f"{name}_adapter_share"] = share
        print(
            f"{name:10s} frozen {base:9.3f} ms   with rank-{args.rank} adapters {lora:9.3f} ms   adapters' share {share:6.1%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **t}, f, indent=2)
    return t


if __name__ == "__main__":
    main()
