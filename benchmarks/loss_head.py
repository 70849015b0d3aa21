"""The LM head's loss on one GPU at the 8-layer benchmark's shape (16,384 tokens x 151,936 words x 2,048 hidden,
bf16), our chunked :func:`linear_cross_entropy` (Triton loss kernel, cuBLAS GEMMs) against quack's kernels
(``quack-kernels``: the same chunked pipeline on its own GEMMs, and its scaled-exp pipeline, whose first GEMM
writes ``exp`` of the logits with per-tile offsets and whose two gradient GEMMs scale that operand as they load
it, so the logits' gradient is never written).

    source benchmarks/gpu_env.sh && python3 benchmarks/loss_head.py [--tokens 16384] [--chunk 4096] [--parts]

Each variant computes the summed loss, the hidden states' gradient and the weight's float32 gradient in one call
(what the forward of :func:`linear_cross_entropy` does); median ms by ``triton.testing.do_bench``, and each
result's error against a float32 reference (loss relative, gradients relative norm).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from moeshard.models.common import linear_cross_entropy
from moeshard.models.common._lm_loss_triton import ce_chunk_triton

V, D = 151936, 2048


def _ours(h, w, t, chunk):
    holder = torch.zeros(w.shape, dtype=torch.float32, device=w.device)

    def run():
        hg = h.detach().requires_grad_()
        wg = w.detach().requires_grad_()
        loss = linear_cross_entropy(
            hg, wg, t, num_items_in_batch=1, chunk_size=chunk, chunk_loss=ce_chunk_triton, grad_target=lambda _: holder
        )
        node = loss.grad_fn.next_functions[0][0]  # the division's input: the chunked sum's node
        saved_h = node.saved_tensors[0]
        return loss, saved_h, node.grad_w_fp32

    return run


def _quack_contextvar_keys() -> None:
    """quack 0.6.5 keys its compiled epilogues by what their functions reference, and refuses a ``ContextVar``
    and other objects of cutlass-dsl 4.8; keyed by name or repr here (a probe, not a fix)."""
    import contextvars

    from quack.gemm_runtime import identity

    original = identity.semantic_value_key

    def keyed(value, seen):
        if isinstance(value, contextvars.ContextVar):
            return ("contextvar", value.name)
        try:
            return original(value, seen)
        except TypeError:  # cutlass-dsl 4.8's helpers: builtins and descriptors, keyed by what they are
            return ("opaque", type(value).__qualname__, repr(value))

    identity.semantic_value_key = keyed


def _reference(h, w, t, chunk):
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
    wf = w.float()
    for s in range(0, h.shape[0], chunk):
        hc = h[s : s + chunk].float()
        z = hc @ wf.t()
        lse = torch.logsumexp(z, -1)
        tc = t[s : s + chunk]
        loss += (lse - z.gather(1, tc[:, None]).squeeze(1)).double().sum()
        g = torch.softmax(z, -1)
        g[torch.arange(len(tc), device=h.device), tc] -= 1
        dh[s : s + chunk] = g @ wf
        dw += g.t() @ hc
    return loss.float(), dh, dw


def _parts(h, w, t) -> None:
    """Each kernel of our pipeline timed alone, per chunk size, and the hidden states' gradient (``g @ w``, K = V)
    in other layouts and with cuBLAS's options. Timed back to back on a GPU that heats as it goes: read it beside a
    profiled step's kernels (``bench --trace``), where the clock is what the power cap leaves."""
    print(f"{'part':<44}{'chunk':>7}{'ms':>9}{'TFLOP/s':>9}  (per chunk)")
    for chunk in (2048, 4096, 8192, 16384):
        _parts_at(h, w, t, chunk)


def _parts_at(h, w, t, chunk: int) -> None:
    def show(name: str, fn, flops: float | None = None) -> None:
        ms = triton.testing.do_bench(fn, warmup=3, rep=30)
        rate = f"{flops / ms / 1e9:>9.0f}" if flops else f"{'':>9}"
        print(f"{name:<44}{chunk:>7}{ms:>9.3f}{rate}")

    hc, tc = h[:chunk], t[:chunk]
    flops = 2 * chunk * V * D
    logits = hc @ w.t()
    _, g = ce_chunk_triton(logits, tc)
    acc = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    out = torch.empty_like(hc)
    show("logits  h @ w.T", lambda: torch.mm(hc, w.t(), out=logits), flops)
    show("dh  mm(g, w, out=)", lambda: torch.mm(g, w, out=out), flops)
    show("dh  mm(w.T, g.T).T", lambda: torch.mm(w.t(), g.t()).t(), flops)
    show("dw first  mm(g.T, h, fp32 out)", lambda: torch.mm(g.t(), hc, out_dtype=torch.float32, out=acc), flops)
    show(
        "dw added  addmm(acc, g.T, h, fp32 out)",
        lambda: torch.addmm(acc, g.t(), hc, out_dtype=torch.float32, out=acc),
        flops,
    )
    show("loss kernel (reads logits twice, writes g)", lambda: ce_chunk_triton(logits, tc))
    if chunk != 4096:
        return
    matmul = torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = not reduced
        show(f"dh  bf16 reduced-precision reduction={not reduced}", lambda: torch.mm(g, w, out=out), flops)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = reduced
    for lib in ("cublaslt", "cublas"):
        previous = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library(lib)
            show(f"dh  preferred_blas_library={lib}", lambda: torch.mm(g, w, out=out), flops)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    acc_h = torch.empty(chunk, D, dtype=torch.float32, device=h.device)
    for split in (2, 4):  # K split by hand: float32 partial sums over slices of the vocabulary

        def split_k(split=split):
            part = V // split
            torch.mm(g[:, :part], w[:part], out_dtype=torch.float32, out=acc_h)
            for s in range(1, split):
                end = V if s == split - 1 else (s + 1) * part
                torch.addmm(acc_h, g[:, s * part : end], w[s * part : end], out_dtype=torch.float32, out=acc_h)
            return acc_h.to(torch.bfloat16)

        show(f"dh  K split in {split}, fp32 adds", split_k, flops)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--parts", action="store_true", help="time each kernel of our pipeline alone, per chunk size")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = (torch.randn(args.tokens, D, device=dev) * 0.5).bfloat16()
    w = (torch.randn(V, D, device=dev) * 0.02).bfloat16()
    t = torch.randint(0, V, (args.tokens,), device=dev)
    if args.parts:
        _parts(h, w, t)
        return
    variants = {"ours (cuBLAS + Triton loss)": _ours(h, w, t, args.chunk)}
    try:
        _quack_contextvar_keys()
        from quack import linear_cross_entropy as qlce

        def quack_chunked():
            loss, dx, dw, last_g, last_x = qlce.chunked_linear_cross_entropy_fwd(h, w, t, args.chunk)
            qlce.gemm_add_inplace(last_g.T, last_x, dw)
            return loss.sum(), dx, dw

        def quack_scaled_exp():
            loss, dx, dw = qlce.scaled_exp_linear_cross_entropy_fwd(h, w, t, args.chunk)
            return loss[: args.tokens].sum(), dx[: args.tokens], dw

        variants["quack chunked"] = quack_chunked
        variants["quack scaled-exp"] = quack_scaled_exp
    except Exception as e:  # absent, or a version this probe does not take
        print(f"quack-kernels not importable ({e}); only ours")
    ref = _reference(h, w, t, args.chunk)
    flops = 3 * 2 * args.tokens * V * D
    print(f"{'variant':<30}{'ms':>9}{'TFLOP/s':>9}  rel err loss / dh / dw")
    for name, fn in variants.items():
        try:
            got = fn()
            errs = " / ".join(f"{_rel(a, b):.1e}" for a, b in zip(got, ref))
            ms = triton.testing.do_bench(fn, warmup=3, rep=30)
        except Exception as e:  # a kernel this build or GPU does not take
            print(f"{name:<30} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        print(f"{name:<30}{ms:>9.3f}{flops / ms / 1e9:>9.0f}  {errs}")


if __name__ == "__main__":
    main()
