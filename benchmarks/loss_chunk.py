"""The LM head's loss chunk on one GPU: Inductor's compiled ``ce_chunk`` against the Triton kernel
(``ce_chunk_triton``), at the benchmark's shape (4,096 tokens x 151,936 words, bf16 logits), with block variants.

    source benchmarks/gpu_env.sh && python3 benchmarks/loss_chunk.py

Prints per variant the median time (``triton.testing.do_bench``), the bytes it must move (logits read twice or
three times, the gradient written once) over that time, and its error against the float32 reference on fresh
random logits (loss relative, gradient max abs)."""

from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

from moeshard.ep import compile_rows_dynamic
from moeshard.models.common import _lm_loss_triton as lt
from moeshard.models.common import ce_chunk

C, V = 4096, 151936


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(C, V, device="cuda", generator=g) * 3).bfloat16()
    targets = torch.randint(0, V, (C,), device="cuda", generator=g)
    targets[::50] = -100
    ref_loss, ref_grad = ce_chunk(logits.double(), targets)
    compiled = compile_rows_dynamic(ce_chunk)

    def kernel(block: int, warps: int):
        def run():
            grad = torch.empty_like(logits)
            loss = torch.empty(C, dtype=torch.float32, device="cuda")
            lt._ce_kernel[(C,)](logits, targets, grad, loss, V, V, V, IGNORE=-100, BLOCK_V=block, num_warps=warps)
            return loss.sum(), grad

        return run

    variants = {"compiled ce_chunk (Inductor)": (lambda: compiled(logits, targets), 3)}
    variants["ce_chunk_triton (shipped)"] = (lambda: lt.ce_chunk_triton(logits, targets), 2)
    for block, warps in ((2048, 4), (4096, 4), (8192, 8), (8192, 16), (16384, 16)):
        variants[f"triton BLOCK_V={block} warps={warps}"] = (kernel(block, warps), 2)
    print(f"{'variant':<36}{'ms':>8}{'TB/s':>7}{'loss rel err':>14}{'grad max err':>14}")
    for name, (fn, reads) in variants.items():
        loss, grad = fn()
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        tbps = (reads + 1) * C * V * 2 / ms / 1e9
        err_l = abs(loss.double() - ref_loss).item() / abs(ref_loss).item()
        err_g = (grad.double() - ref_grad.double()).abs().max().item()
        print(f"{name:<36}{ms:>8.3f}{tbps:>7.2f}{err_l:>14.2e}{err_g:>14.2e}")


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    main()
