"""The LM head's loss chunk on one GPU: Inductor's compiled ``ce_chunk`` against the Triton kernel
(``ce_chunk_triton``), at the benchmark's shape (4,096 tokens x 151,936 words, bf16 logits), with block variants.

    source benchmarks/gpu_env.sh && python3 benchmarks/loss_chunk.py

Prints per variant the median time (``triton.testing.do_bench``), the bytes it must move (logits read twice or
three times, the gradient written once) over that time, and its error against the float32 reference on fresh
random logits (loss relative, gradient max abs).

The persistent variants (a grid of P programs, each taking rows P apart) ask whether the second read of a row can
come from the L2 cache: with one or two programs per SM, 132-264 rows of 304 KB are in flight (40-80 MB, about the
cache's 50 MB), where the shipped grid of one program per row keeps ~1,000 in flight and reads every row from
memory twice. If it holds, a chunk moves 2.5 GB instead of 3.7 (-0.3 ms per 4,096 tokens at 4 TB/s); the TB/s
column counts the shipped kernel's 3.7 GB for them too, so above ~4.5 it is the cache's doing.
    TRITON_INTERPRET=1 python3 benchmarks/loss_chunk.py --check     # CPU: the persistent kernel on small shapes
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from moeshard.ep import compile_rows_dynamic
from moeshard.models.common import _lm_loss_triton as lt
from moeshard.models.common import ce_chunk

C, V = 4096, 151936


@triton.jit
def _ce_persistent_kernel(
    logits_ptr, targets_ptr, grad_ptr, loss_ptr, C, V, stride_l, stride_g, IGNORE: tl.constexpr, BLOCK_V: tl.constexpr
):
    # the shipped kernel's row (lt._ce_row), for rows pid, pid + P, pid + 2P, ...
    zero = tl.program_id(0).to(tl.int64) * 0  # rows as int64 (the interpreter's loop variable is a Python int)
    for r in range(tl.program_id(0), C, tl.num_programs(0)):
        lt._ce_row(
            logits_ptr,
            targets_ptr,
            grad_ptr,
            loss_ptr,
            loss_ptr,
            zero + r,
            V,
            stride_l,
            stride_g,
            IGNORE,
            BLOCK_V,
            False,
        )


def persistent(logits, targets, programs: int, block: int = 4096, warps: int = 8):
    c, v = logits.shape
    grad = torch.empty_like(logits)
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    _ce_persistent_kernel[(min(programs, c),)](
        logits, targets, grad, loss, c, v, v, v, IGNORE=-100, BLOCK_V=block, num_warps=warps
    )
    return loss.sum(), grad


def check() -> None:
    """The persistent kernel against ``ce_chunk`` on CPU tensors (triton's interpreter)."""
    from moeshard.ep.testing import interpreter_numpy_fix

    interpreter_numpy_fix()
    g = torch.Generator().manual_seed(0)
    for c, v, programs in ((7, 300, 3), (5, 1000, 8)):
        logits = torch.randn(c, v, generator=g) * 3
        targets = torch.randint(0, v, (c,), generator=g)
        targets[1] = -100
        loss, grad = persistent(logits, targets, programs, block=128, warps=4)
        want_loss, want_grad = ce_chunk(logits.double(), targets)
        torch.testing.assert_close(loss.double(), want_loss.double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.double(), want_grad.double(), rtol=1e-5, atol=1e-6)
    print("persistent kernel: checked 2 cases")


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
            lt._ce_kernel[(C,)](
                logits, targets, grad, loss, loss, V, V, V, IGNORE=-100, BLOCK_V=block, HAS_SCALE=False, num_warps=warps
            )
            return loss.sum(), grad

        return run

    variants = {"compiled ce_chunk (Inductor)": (lambda: compiled(logits, targets), 3)}
    variants["ce_chunk_triton (shipped)"] = (lambda: lt.ce_chunk_triton(logits, targets), 2)
    for block, warps in ((2048, 4), (4096, 4), (8192, 8), (8192, 16), (16384, 16)):
        variants[f"triton BLOCK_V={block} warps={warps}"] = (kernel(block, warps), 2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in (1, 2, 4):
        variants[f"persistent, {per_sm} program(s) per SM"] = (
            lambda p=per_sm * sms: persistent(logits, targets, p),
            2,
        )
    print(f"{'variant':<36}{'ms':>8}{'TB/s':>7}{'loss rel err':>14}{'grad max err':>14}")
    for name, (fn, reads) in variants.items():
        loss, grad = fn()
        ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
        tbps = (reads + 1) * C * V * 2 / ms / 1e9
        err_l = abs(loss.double() - ref_loss).item() / abs(ref_loss).item()
        err_g = (grad.double() - ref_grad.double()).abs().max().item()
        print(f"{name:<36}{ms:>8.3f}{tbps:>7.2f}{err_l:>14.2e}{err_g:>14.2e}")


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    else:
        print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
        main()
