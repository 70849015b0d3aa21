"""How much of the experts' AdamW update a forward running beside it can hide, on one H200.

    python3 benchmarks/update_overlap.py [--layers 4] [--tokens 16384]

The step's optimizer is memory-bound (~38 ms of a ~211 ms step at micro-batch 4, 8 layers) and runs alone between
the backward and the next forward. The next forward's layer ``i`` needs only layer ``i``'s parameters updated, so
the updates could run on a side stream, one layer ahead of the forward that waits for each. This probe asks what
that would save before anything is built: per layer of the 30B-A3B geometry it times

- the forward's large kernels at micro-batch 4: the q/k/v and output projections, cuDNN's causal attention
  (32 query and 4 key/value heads of 128), and the experts' two grouped GEMMs (top-8 of 128 experts, even counts);
- the local experts' update as ``LocalExpertAdamW`` runs it (``_triton.adamw_update_split``: split masters, bf16
  gradient, 26 bytes per parameter) over one layer's 128 x 3 x 2,048 x 768 parameters;

then ``layers`` of them one after the other (the step as it is), and with the updates on a side stream, each
layer's forward waiting for its own update (the schedule above), and with no waits at all (the bound). Prints the
milliseconds of each and the share of the update time hidden. Timed by CUDA events, median of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from moeshard.fsdp_moe import _triton


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    dev, bf = "cuda", torch.bfloat16
    T, D, E, K, F_ = args.tokens, 2048, 128, 8, 768
    H, KV, Dh, S = 32, 4, 128, 4096
    B = T // S
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf, scale=0.02):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

    x = rnd(T, D, scale=1.0)
    w_qkv, w_o = rnd(D, (H + 2 * KV) * Dh), rnd(H * Dh, D)
    rows = T * K
    xe = rnd(rows, D, scale=1.0)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (rows // E)
    w_gu, w_dn = rnd(E, D, 2 * F_), rnd(E, F_, D)
    he = rnd(rows, F_, scale=1.0)

    def forward_layer() -> None:
        qkv = x @ w_qkv
        q = qkv[:, : H * Dh].view(B, S, H, Dh).transpose(1, 2)
        k = qkv[:, H * Dh : (H + KV) * Dh].view(B, S, KV, Dh).transpose(1, 2)
        v = qkv[:, (H + KV) * Dh :].view(B, S, KV, Dh).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.transpose(1, 2).reshape(T, H * Dh) @ w_o
        torch._grouped_mm(xe, w_gu, offs=offs)
        torch._grouped_mm(he, w_dn, offs=offs)

    n = E * 3 * D * F_
    states = []
    for _ in range(args.layers):
        hi = rnd(n)
        states.append((hi, torch.zeros(n, device=dev, dtype=torch.int16), rnd(n, scale=1e-3), rnd(n, dtype=torch.float32,
                       scale=1e-3), rnd(n, dtype=torch.float32, scale=1e-3).abs_()))  # fmt: skip
    kw = dict(decay=1 - 1e-4 * 0.01, beta1=0.9, beta2=0.95, step_size=1e-4, bias_correction2_sqrt=0.7, eps=1e-8)

    def update(i: int) -> None:
        hi, lo, g16, m, v = states[i]
        _triton.adamw_update_split(hi, lo, g16, m, v, 0.5, None, **kw)

    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()

    def serial() -> None:
        for i in range(args.layers):
            update(i)
        for _ in range(args.layers):
            forward_layer()

    def pipelined(wait: bool) -> None:
        side.wait_stream(main_stream)
        events = []
        with torch.cuda.stream(side):
            for i in range(args.layers):
                update(i)
                events.append(torch.cuda.Event())
                events[-1].record(side)
        for i in range(args.layers):
            if wait:
                main_stream.wait_event(events[i])
            forward_layer()
        main_stream.wait_stream(side)

    def only_forward() -> None:
        for _ in range(args.layers):
            forward_layer()

    def only_update() -> None:
        for i in range(args.layers):
            update(i)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b))
        return statistics.median(out)

    print(
        f"{torch.cuda.get_device_name()}: {args.layers} layers, {T} tokens, {n / 1e6:.0f} M expert parameters a layer"
    )
    fwd, upd = timed(only_forward), timed(only_update)
    ser, pipe, free = timed(serial), timed(lambda: pipelined(True)), timed(lambda: pipelined(False))
    print(f"forward's large kernels alone {fwd:8.2f} ms ({fwd / args.layers:.2f} a layer)")
    print(f"experts' updates alone        {upd:8.2f} ms ({upd / args.layers:.2f} a layer, "
          f"{26 * n * args.layers / upd / 1e9:.2f} TB/s)")  # fmt: skip
    print(f"one after the other           {ser:8.2f} ms")
    for name, t in (("side stream, each layer waits", pipe), ("side stream, no waits", free)):
        print(f"{name:29s} {t:8.2f} ms: {ser - t:+.2f} ms against serial, {100 * (ser - t) / upd:.0f}% of the "
              f"updates hidden")  # fmt: skip


if __name__ == "__main__":
    main()
