"""The LM head's part of one training step on one GPU, with and without this round's two changes (issue 31): the
loss's divisor folded into the logit gradient (models-common 0.1.16: backward's factor is one and ``scale_`` skips
the pass over the float32 ``[V, D]`` gradient) and, at micro-batch 1, the later micro-batches' weight gradient added
into FSDP2's held one by backward's GEMM (``ReducedGrad.add_product_``). The step's figure cannot resolve either
(its spread is ~3 ms); this times the head alone, at the 8-layer benchmark's shape (4 x 4,096 tokens per step,
151,936 x 2,048, bf16, the Triton loss kernel).

    source benchmarks/gpu_env.sh && python3 benchmarks/head_fold.py
    python3 benchmarks/head_fold.py --cpu-check      # CPU: the three variants give the same gradients (small shapes)

Variants, each a step's head: the forward and backward of every micro-batch into a float32 gradient held as FSDP2
holds it (``ReducedGrad`` over a stand-in for FSDP2's parameter record), then the hidden states' gradients and the
held weight gradient read:
- ``old``: no fold (the factor is 1/N, so ``scale_`` / ``scaled_add_`` scale), no product in backward;
- ``fold``: the divisor folded in (factor one);
- ``fold+add``: and the later micro-batches' product added in backward (micro-batch 1 only: one chunk each).

Prints per micro-batch size the median ms per step (``triton.testing.do_bench``) and the peak allocated memory
above the inputs, and the held gradient's relative difference to ``old``'s. Predicted (NOTES): ``fold`` -0.6 to -0.7
ms at 1 and 4; ``fold+add`` a further ~-2.2 ms at 1 and ~-1.2 GB of peak.
"""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace

import torch

import moeshard.models.common._lm_loss as lm_loss
from moeshard.fsdp_moe import ReducedGrad
from moeshard.models.common import linear_cross_entropy


class _NoProduct(ReducedGrad):
    """A ReducedGrad without ``add_product_``: the head hands over its float32 product, as before this round."""

    add_product_ = None


@contextlib.contextmanager
def _fold(on: bool):
    kept = lm_loss._FOLDS_SCALE
    lm_loss._FOLDS_SCALE = kept if on else ()
    try:
        yield
    finally:
        lm_loss._FOLDS_SCALE = kept


def step(h, w, t, micro_batches: int, variant: str, chunk_loss):
    """One step's head: returns the held float32 weight gradient and the hidden states' gradients."""
    record = SimpleNamespace(reduce_dtype=torch.float32, _unsharded_param=w, unsharded_accumulated_grad=None)
    kind = _NoProduct if variant != "fold+add" else ReducedGrad
    target = kind(record)
    n = t.numel() - 3  # not a power of two: the fold rounds otherwise than the old order
    grads = []
    with _fold(variant != "old"):
        for hm, tm in zip(h.chunk(micro_batches), t.chunk(micro_batches)):
            hg = hm.detach().requires_grad_()
            loss = linear_cross_entropy(
                hg, w, tm, num_items_in_batch=n, chunk_loss=chunk_loss, grad_target=lambda _: target
            )
            loss.backward()
            grads.append(hg.grad)
    return record.unsharded_accumulated_grad, grads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cpu-check", action="store_true")
    args = parser.parse_args()
    if args.cpu_check:
        from moeshard.models.common import ce_chunk

        g = torch.Generator().manual_seed(0)
        v, d, tokens, chunk_loss, device = 1000, 32, 64, ce_chunk, "cpu"
        h = torch.randn(tokens, d, generator=g).bfloat16()
        w = torch.randn(v, d, generator=g).bfloat16().requires_grad_()
        t = torch.randint(0, v, (tokens,), generator=g)
    else:
        from moeshard.models.common._lm_loss_triton import ce_chunk_triton

        v, d, tokens, chunk_loss, device = 151936, 2048, args.tokens, ce_chunk_triton, "cuda"
        h = torch.randn(tokens, d, device=device).bfloat16()
        w = (torch.randn(v, d, device=device) * 0.02).bfloat16().requires_grad_()
        t = torch.randint(0, v, (tokens,), device=device)
    for mb in (1, 4):
        micro_batches = 4 // mb  # 4 x tokens/4 per step, as the benchmark's 4 x 4,096
        ref, ref_h = step(h, w, t, micro_batches, "old", chunk_loss)
        for variant in ("old", "fold", "fold+add"):
            if variant == "fold+add" and mb != 1:
                continue
            held, gh = step(h, w, t, micro_batches, variant, chunk_loss)
            diff = float((held - ref).norm() / ref.norm())
            diff_h = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(gh, ref_h))
            if args.cpu_check:
                print(f"micro-batch {mb} ({micro_batches} per step), {variant}: held {diff:.2e}, hidden {diff_h:.2e}")
                assert diff < 2e-2 and diff_h < 2e-2, (variant, diff, diff_h)
                continue
            import triton.testing

            del held, gh
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = triton.testing.do_bench(lambda m=micro_batches, x=variant: step(h, w, t, m, x, chunk_loss), rep=500)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            print(
                f"micro-batch {mb} ({micro_batches} per step), {variant:9s}: {ms:7.2f} ms, peak +{peak:5.2f} GiB, "
                f"held vs old {diff:.1e}, hidden vs old {diff_h:.1e}"
            )
    if args.cpu_check:
        print("cpu check passed")


if __name__ == "__main__":
    main()
