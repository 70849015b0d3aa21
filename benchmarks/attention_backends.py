"""Causal attention at Qwen3-30B-A3B's shape on one GPU, forward and forward + backward, per SDPA backend and
flex_attention: which kernel the model's plain-causal ``attend`` should run.

    source benchmarks/gpu_env.sh && python3 benchmarks/attention_backends.py [--batch 4,1] [--seq 4096]

q ``[B, 32, S, 128]``, k and v ``[B, 4, S, 128]`` (GQA 8:1), bf16, ``is_causal``. Each variant is checked against
the flash backend (output and the three input gradients, relative norm error) before it is timed
(``triton.testing.do_bench``, median). A backend that cannot take GQA runs on k and v repeated to 32 heads, the
repeat (and its backward, the sum over the 8 copies) timed inside it. TFLOP/s by the brief's formula: forward +
backward 6·2·(S/2)·(heads·head_dim) per token, the forward a third of it.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

H, G, D = 32, 4, 128


def _sdpa(backend: SDPBackend | None, gqa: bool):
    """SDPA restricted to ``backend`` (None: SDPA's own choice), on GQA k and v or on k and v repeated to H heads."""

    def run(q, k, v):
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            rep = H // G
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True
            )

    return run


def _flex(S: int, dev):
    mask = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, S, S, device=dev)
    compiled = torch.compile(flex_attention)

    def run(q, k, v):
        return compiled(q, k, v, block_mask=mask, enable_gqa=True)

    return run


def _fa4():
    """FlashAttention 4's CuTe kernels (``flash_attn.cute``, the ``flash-attn-4`` wheel; its SM90 path on Hopper), on
    ``[B, S, heads, D]`` views of the same tensors; None where the package is absent."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None

    def run(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return run


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _time(fn, q, k, v, dout) -> tuple[float, float]:
    """Median ms of the forward and of forward + backward."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=5, rep=40)
    both = triton.testing.do_bench(lambda: fn(qg, kg, vg).backward(dout), warmup=5, rep=40, grad_to_none=[qg, kg, vg])
    return fwd, both


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="4,1")
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args()
    dev, S = torch.device("cuda"), args.seq
    print(f"{'B':>2} {'variant':<22}{'fwd ms':>8}{'fwd TF/s':>9}{'f+b ms':>8}{'f+b TF/s':>9}  rel err out/dq/dk/dv")
    for B in (int(b) for b in args.batch.split(",")):
        torch.manual_seed(0)
        q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, G, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, G, S, D, device=dev, dtype=torch.bfloat16)
        dout = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        flops_fb = 6 * 2 * (S / 2) * H * D * B * S
        variants = {
            "default (gqa)": _sdpa(None, True),
            "flash (gqa)": _sdpa(SDPBackend.FLASH_ATTENTION, True),
            "cudnn (gqa)": _sdpa(SDPBackend.CUDNN_ATTENTION, True),
            "cudnn (kv repeated)": _sdpa(SDPBackend.CUDNN_ATTENTION, False),
            "efficient (repeated)": _sdpa(SDPBackend.EFFICIENT_ATTENTION, False),
            "flex (compiled)": _flex(S, dev),
        }
        if (fa4 := _fa4()) is not None:
            variants["fa4 (flash_attn.cute)"] = fa4
        ref = _grads(variants["flash (gqa)"], q, k, v, dout)
        for name, fn in variants.items():
            try:
                got = _grads(fn, q, k, v, dout)
            except Exception as e:  # a backend this build or shape does not take
                print(f"{B:>2} {name:<22}  not available: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
                continue
            errs = "/".join(f"{_rel(a, b):.1e}" for a, b in zip(got, ref))
            fwd, both = _time(fn, q, k, v, dout)
            print(
                f"{B:>2} {name:<22}{fwd:>8.3f}{flops_fb / 3 / fwd / 1e9:>9.0f}{both:>8.3f}{flops_fb / both / 1e9:>9.0f}"
                f"  {errs}"
            )


if __name__ == "__main__":
    main()
