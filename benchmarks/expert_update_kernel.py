"""The local experts' fused AdamW update against torch's fused AdamW on one H200 (bandwidth of each pass).

    python3 benchmarks/expert_update_kernel.py [--numel 100_000_000] [--sweep]

Per parameter the fused update reads the bf16 gradient, the float32 master and both moments and writes the master,
the moments and the bf16 compute copy (30 bytes); the unfused path costs the forward's cast (6), the gradient's
cast-and-scale into float32 (6), the clip norm's read (4) and torch's fused AdamW with the clip's grad_scale
(32: it writes the clipped gradient back). Prints the time and bandwidth of each; also the one-pass update of a
float32 parameter with a float32 gradient (``OnePassAdamW``, 28 B/param) and a device-to-device copy for the
ceiling. ``--sweep``: the update's kernel at other block sizes and warp counts (the shipped ones: 2048, 8 warps).
``--split``: also a probe of masters held split, the bf16 parameter as the high half of each float32 master and an
int16 tensor of the low halves (the bf16 copy rounded to nearest, ties away from zero, so the float32 master is
exactly ``bits(bf16) << 16 + int16(low)``): 26 bytes per parameter and no float32 master; checked against the
shipped kernel (the same masters bit for bit, the bf16 copies equal but for ties) before it is timed. Not shipped.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from moeshard.fsdp_moe import _triton


@triton.jit
def _split_adamw_kernel(hi_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, n, g_scale, decay, beta2, one_minus_beta1,
                        one_minus_beta2, step_size, bias_correction2_sqrt, eps, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * g_scale
    hi = tl.load(hi_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    lo = tl.load(lo_ptr + offs, mask=mask, other=0, eviction_policy="evict_first").to(tl.int32)
    p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    bits = p.to(tl.int32, bitcast=True)
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    tl.store(hi_ptr + offs, hi.to(tl.int16), mask=mask)
    tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi as bf16, lo as int16)`` with ``bits(master) == bits(hi) << 16 + lo`` (finite masters)."""
    bits = master.view(torch.int32).to(torch.int64)
    hi = (bits + 0x8000) >> 16
    lo = bits - (hi << 16)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def joined(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    bits = (hi.view(torch.int16).to(torch.int64) << 16) + lo.to(torch.int64)
    return bits.to(torch.int32).view(torch.float32)


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--split", action="store_true")
    args = p.parse_args()
    n = args.numel
    dev = "cuda"
    param, m, v = (torch.randn(n, device=dev) for _ in range(3))
    v.abs_()
    g16 = torch.randn(n, device=dev, dtype=torch.bfloat16)
    copy = torch.empty(n, device=dev, dtype=torch.bfloat16)
    gs = torch.tensor(1.5, device=dev)
    step = torch.tensor(10.0, device=dev)
    g32 = g16.float() * 0.5
    kw = dict(decay=1 - 1e-4 * 0.01, beta1=0.9, beta2=0.95, step_size=1e-4, bias_correction2_sqrt=0.7, eps=1e-8)
    rows = {
        "fused expert update (30 B/param)": (
            lambda: _triton.adamw_update(param, g16, m, v, copy, 0.5, None, gs, **kw),
            30,
        ),
        "torch fused AdamW + grad_scale (32 B/param)": (
            lambda: torch._fused_adamw_(
                [param],
                [g32],
                [m],
                [v],
                [],
                [step],
                lr=1e-4,
                beta1=0.9,
                beta2=0.95,
                weight_decay=0.01,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
                grad_scale=gs,
                found_inf=None,
            ),
            32,
        ),
        "one-pass update, fp32 gradient (OnePassAdamW, 28 B/param)": (
            lambda: _triton.adamw_update(param, g32, m, v, None, 1.0, gs, None, **kw),
            28,
        ),
        "device-to-device copy, fp32 (8 B/param)": (lambda: m.copy_(v), 8),
        "forward cast fp32 -> bf16 (6 B/param)": (lambda: copy.copy_(param), 6),
        "gradient cast-and-scale bf16 -> fp32 (6 B/param)": (lambda: torch.mul(g16, 0.5, out=g32), 6),
        "clip norm of the fp32 gradient (4 B/param)": (lambda: torch._foreach_norm([g32], 2.0), 4),
        "clip norm of the bf16 gradient (2 B/param)": (lambda: torch._foreach_norm([g16], 2.0, dtype=torch.float32), 2),
    }
    print(f"{n:,} parameters on {torch.cuda.get_device_name()}")
    for name, (fn, nbytes) in rows.items():
        ms = timed(fn)
        print(f"{name:52s} {ms:7.3f} ms  {nbytes * n / ms / 1e9:6.2f} TB/s")
    if args.sweep:
        sweep(param, g16, g32, m, v, copy, gs, kw)
    if args.split:
        split_probe(param, g16, m, v, copy, kw)


def split_probe(param, g16, m, v, copy, kw) -> None:
    """The split masters' update against the shipped one: checked, then timed."""
    n = param.numel()
    scalars = (kw["decay"], kw["beta2"], 1 - kw["beta1"], 1 - kw["beta2"], kw["step_size"],
               kw["bias_correction2_sqrt"], kw["eps"])  # fmt: skip
    master = (param * 0.02).contiguous()
    assert torch.equal(joined(*split(master)), master)
    ref, ref_m, ref_v = master.clone(), m.clone(), v.clone()
    hi, lo = split(master)
    sm, sv = m.clone(), v.clone()
    for _ in range(3):
        _triton.adamw_update(ref, g16, ref_m, ref_v, copy, 0.5, None, None, **kw)
        _split_adamw_kernel[(triton.cdiv(n, 1024),)](hi.view(torch.int16), lo, g16, sm, sv, n, 0.5, *scalars,
                                                     BLOCK=1024, num_warps=8)  # fmt: skip
    assert torch.equal(joined(hi, lo), ref), "split masters differ from the float32 ones"
    assert torch.equal(sm, ref_m) and torch.equal(sv, ref_v)
    ties = (ref.view(torch.int32) & 0xFFFF) == 0x8000
    differ = hi.view(torch.int16) != copy.view(torch.int16)
    assert bool((differ & ~ties).sum() == 0), "bf16 copies differ away from ties"
    print(f"split masters: equal to the float32 path after 3 steps; bf16 copies differ at {int(differ.sum())} ties "
          f"of {n:,}")  # fmt: skip

    def run():
        _split_adamw_kernel[(triton.cdiv(n, 1024),)](hi.view(torch.int16), lo, g16, sm, sv, n, 0.5, *scalars,
                                                     BLOCK=1024, num_warps=8)  # fmt: skip

    for name, fn, nbytes in (
        ("shipped update, bf16 grad + bf16 copy (28 B/param)", lambda: _triton.adamw_update(
            ref, g16, ref_m, ref_v, copy, 0.5, None, None, **kw), 28),
        ("split masters, bf16 grad (26 B/param)", run, 26),
    ):  # fmt: skip
        ms = timed(fn)
        print(f"{name:52s} {ms:7.3f} ms  {nbytes * n / ms / 1e9:6.2f} TB/s")


def sweep(param, g16, g32, m, v, copy, gs, kw) -> None:
    """The update's kernel launched as ``adamw_update`` launches it, at other blocks and warp counts."""
    import triton

    n = param.numel()
    scalars = dict(
        decay=kw["decay"],
        beta2=kw["beta2"],
        one_minus_beta1=1 - kw["beta1"],
        one_minus_beta2=1 - kw["beta2"],
        step_size=kw["step_size"],
        bias_correction2_sqrt=kw["bias_correction2_sqrt"],
        eps=kw["eps"],
    )
    for label, grad, out, nbytes in (("bf16 grad + bf16 copy", g16, copy, 30), ("fp32 grad", g32, None, 28)):
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):

                def run(block=block, warps=warps, grad=grad, out=out):
                    _triton._adamw_kernel[(triton.cdiv(n, block),)](
                        param, grad, m, v, out if out is not None else param, gs, param, n, 0.5,
                        *scalars.values(), HAS_COPY=out is not None, HAS_MULT=True, HAS_GS=False, BLOCK=block,
                        num_warps=warps,
                    )  # fmt: skip

                ms = timed(run)
                print(
                    f"sweep {label:22s} BLOCK {block:5d} warps {warps:2d} {ms:7.3f} ms  {nbytes * n / ms / 1e9:6.2f} TB/s"
                )


if __name__ == "__main__":
    main()
