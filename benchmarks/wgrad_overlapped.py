"""The overlapped dispatcher's expert weight gradients at EP size P, per layer: today's schedule against one parts
kernel over its three passes.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_overlapped.py     # EP 2, 4 and 8 (EPS="2 8": some)
    TRITON_INTERPRET=1 python3 benchmarks/wgrad_overlapped.py --check          # CPU: small shapes, checks only

At EP size P a rank holds 128 / P of the 128 experts. Per micro-batch of 4,096 tokens x top-8 on each rank it runs
its own copies in two halves (experts [0, E/2) and [E/2, E), about N / P rows of N = 32,768) and the copies the
other ranks sent (about N (P - 1) / P rows, every local expert). Per weight (gate/up ``[E, 1536, 2048]``: ``a`` the
gate/up output's gradient, ``b`` the input rows; down ``[E, 2048, 768]``: ``a`` the output's gradient, ``b`` the
gated activation), ms (``do_bench`` median):

- ``write, today``: the first micro-batch without kept factors: torch's ``grouped_mm`` per pass, the halves added
  into the received pass's slices (what ``_OverlappedExperts.backward`` does);
- ``write, parts``: ``grouped_weight_grad_parts`` over the three parts (the halves' offsets widened over all local
  experts, as the dispatcher offers them), written once;
- ``add, today``: a later micro-batch where nothing is deferred: the same, then one ``add_`` into the held gradient;
- ``add, parts``: the parts kernel adding into the held gradient;
- ``deferred step``: two micro-batches' six parts formed at once (``sum_weight_grads``: two launches).

Each schedule is checked against a float64 sum before it is timed (relative error printed; bf16 rounding ~2e-3).

("today" is ep 0.4.1's schedule. On one H200 the parts kernel won at every EP size, writing and adding
(``benchmarks/NOTES.md``, 2026-12-04), and ep 0.4.2 forms the overlapped dispatcher's gradients with it.)
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F

from moeshard.ep._dispatch.overlapped import _widen
from moeshard.ep._wgrad_triton import grouped_weight_grad_parts

EXPERTS, TOPK, TOKENS = 128, 8, 4096
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}


def _rows(counts: torch.Tensor, M: int, K: int, g: torch.Generator, device, dtype):
    n = int(counts.sum())
    a = (torch.randn(n, M, generator=g) / 8).to(device, dtype)
    b = (torch.randn(n, K, generator=g) / 8).to(device, dtype)
    return a, b


def micro_batch(ep: int, experts: int, tokens: int, M: int, K: int, g: torch.Generator, device, dtype):
    """One micro-batch's three passes on one rank: ``(half A, received, half B)``, each ``(a, b, offsets)`` with
    the offsets of its own experts, and ``half``: the first expert of half B."""
    El = experts // ep

    def counts_from(ranks: int) -> torch.Tensor:
        ids = torch.randn(ranks * tokens, experts, generator=g).topk(TOPK, dim=-1).indices
        return torch.bincount(ids.flatten(), minlength=experts)[:El]  # copies for this rank's experts

    own, received = counts_from(1), counts_from(ep - 1)
    half = El // 2
    a, b = _rows(own, M, K, g, device, dtype)
    split = int(own[:half].sum())
    a_r, b_r = _rows(received, M, K, g, device, dtype)

    def ends(c):
        return torch.cumsum(c, 0).to(device=device, dtype=torch.int32)

    passes = (
        (a[:split], b[:split], ends(own[:half])),
        (a_r, b_r, ends(received)),
        (a[split:], b[split:], ends(own[half:])),
    )
    return passes, half


def widened(passes, half: int, El: int):
    """The three passes as the dispatcher offers them: every part's offsets over all ``El`` local experts."""
    (a0, b0, o0), (a1, b1, o1), (a2, b2, o2) = passes
    return [(a0, b0, _widen(o0, 0, El)), (a1, b1, o1), (a2, b2, _widen(o2, half, El))]


def today(passes, half: int):
    """``_OverlappedExperts.backward``'s weight gradient without a taking target: one ``grouped_mm`` per pass, the
    halves added into the received pass's slices."""
    (a0, b0, o0), (a1, b1, o1), (a2, b2, o2) = passes
    grad = F.grouped_mm(a1.transpose(0, 1), b1, offs=o1)
    grad[:half].add_(F.grouped_mm(a0.transpose(0, 1), b0, offs=o0))
    grad[half:].add_(F.grouped_mm(a2.transpose(0, 1), b2, offs=o2))
    return grad


def reference(parts, El: int, M: int, K: int) -> torch.Tensor:
    out = torch.zeros(El, M, K, dtype=torch.float64)
    for a, b, offs in parts:
        start = 0
        for e, end in enumerate(offs.tolist()):
            out[e] += a[start:end].double().cpu().T @ b[start:end].double().cpu()
            start = end
    return out


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def _schedules(passes, half, parts, parts2, held, ref, El, M, K) -> dict:
    """``{name: (run, what it must give)}``."""
    out = torch.empty(El, M, K, device=held.device, dtype=held.dtype)
    want_added = held.double().cpu() + ref
    return {
        "write, today": (functools.partial(today, passes, half), ref),
        "write, parts": (functools.partial(grouped_weight_grad_parts, parts, out, accumulate=False), ref),
        "add, today": (lambda: held.clone().add_(today(passes, half)), want_added),
        "add, parts": (lambda: grouped_weight_grad_parts(parts, held.clone(), accumulate=True), want_added),
        "deferred step": (
            functools.partial(grouped_weight_grad_parts, parts2, out, accumulate=False),
            reference(parts2, El, M, K),
        ),
    }


def run(eps, experts, tokens, shapes, device, dtype, time: bool) -> int:
    """Every schedule at each EP size and weight: checked (and timed with ``time``); returns the schedules checked."""
    g = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    checked = 0
    if time:
        import triton.testing

        print(f"{'EP':>3} {'weight':>8} {'schedule':>16} {'ms':>7} {'rel err':>8}")
    for ep in eps:
        El = experts // ep
        for wname, (M, K) in shapes.items():
            passes, half = micro_batch(ep, experts, tokens, M, K, g, device, dtype)
            parts = widened(passes, half, El)
            ref = reference(parts, El, M, K)
            held = (torch.randn(El, M, K, generator=g) / 8).to(device, dtype)
            second, _ = micro_batch(ep, experts, tokens, M, K, g, device, dtype)
            parts2 = parts + widened(second, half, El)
            schedules = _schedules(passes, half, parts, parts2, held, ref, El, M, K)
            for name, (fn, want) in schedules.items():
                err = _err(fn(), want)
                assert err < tol, (ep, wname, name, err)
                checked += 1
                if time:  # the clones of "add" are timed too: ~one pass over the gradient, alike for both
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200)
                    print(f"{ep:>3} {wname:>8} {name:>16} {ms:7.3f} {err:8.1e}")
    return checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="small float32 shapes on CPU, checks only")
    args = parser.parse_args()
    eps = [int(p) for p in os.environ.get("EPS", "2 4 8").split()]
    if args.check:  # the schedules' arithmetic, not their speed (the parts kernel under triton's interpreter)
        from moeshard.ep.testing import interpreter_numpy_fix

        interpreter_numpy_fix()
        n = run(eps, 16, 64, {"gate_up": (32, 16), "down": (16, 32)}, "cpu", torch.float32, time=False)
        print(f"checked {n} schedules")
        return
    run(eps, EXPERTS, TOKENS, SHAPES, "cuda", torch.bfloat16, time=True)


if __name__ == "__main__":
    main()
