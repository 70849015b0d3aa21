"""The local experts' fused AdamW update against torch's fused AdamW on one H200 (bandwidth of each pass).

    python3 benchmarks/expert_update_kernel.py [--numel 100_000_000] [--sweep]

Per parameter the fused update reads the bf16 gradient, the float32 master and both moments and writes the master,
the moments and the bf16 compute copy (30 bytes); the unfused path costs the forward's cast (6), the gradient's
cast-and-scale into float32 (6), the clip norm's read (4) and torch's fused AdamW with the clip's grad_scale
(32: it writes the clipped gradient back). Prints the time and bandwidth of each; also the one-pass update of a
float32 parameter with a float32 gradient (``OnePassAdamW``, 28 B/param) and a device-to-device copy for the
ceiling. ``--sweep``: the update's kernel at other block sizes and warp counts (the shipped ones: 2048, 8 warps).
``--split``: also the update of masters held split (``_triton.adamw_update_split``, what ``LocalExpertAdamW`` runs
with a bf16 compute dtype): the bf16 parameter as the high half of each float32 master and an int16 tensor of the
low halves (``moeshard.fsdp_moe.split_master``), 26 bytes per parameter; checked against the float32 kernel (the
same masters bit for bit, the bf16 copies equal but for ties) before it is timed.
"""

from __future__ import annotations

import argparse

import torch

from moeshard.fsdp_moe import _triton, joined_master, split_master


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
    """The split masters' update against the float32 one: checked, then timed."""
    n = param.numel()
    master = (param * 0.02).contiguous()
    assert torch.equal(joined_master(*split_master(master)), master)
    ref, ref_m, ref_v = master.clone(), m.clone(), v.clone()
    hi, lo = split_master(master)
    sm, sv = m.clone(), v.clone()
    for _ in range(3):
        _triton.adamw_update(ref, g16, ref_m, ref_v, copy, 0.5, None, None, **kw)
        _triton.adamw_update_split(hi, lo, g16, sm, sv, 0.5, None, **kw)
    assert torch.equal(joined_master(hi, lo), ref), "split masters differ from the float32 ones"
    assert torch.equal(sm, ref_m) and torch.equal(sv, ref_v)
    ties = (ref.view(torch.int32) & 0xFFFF) == 0x8000
    differ = hi.view(torch.int16) != copy.view(torch.int16)
    assert bool((differ & ~ties).sum() == 0), "bf16 copies differ away from ties"
    print(f"split masters: equal to the float32 path after 3 steps; bf16 copies differ at {int(differ.sum())} ties "
          f"of {n:,}")  # fmt: skip
    for name, fn, nbytes in (
        ("float32 master, bf16 grad + bf16 copy (28 B/param)", lambda: _triton.adamw_update(
            ref, g16, ref_m, ref_v, copy, 0.5, None, None, **kw), 28),
        ("split masters, bf16 grad (26 B/param)", lambda: _triton.adamw_update_split(
            hi, lo, g16, sm, sv, 0.5, None, **kw), 26),
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
