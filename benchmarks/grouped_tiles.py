"""The experts' forward and input-gradient GEMMs at few rows per expert: torch's ``grouped_mm`` against a Triton
grouped GEMM whose row tile is a parameter (Hopper, TMA).

    source benchmarks/gpu_env.sh && python3 benchmarks/grouped_tiles.py
    TRITON_INTERPRET=1 python3 benchmarks/grouped_tiles.py --cpu-check     # logic only, tiny shapes, no GPU

``out[rows_e] = a[rows_e] @ B_e`` for every expert ``e`` (rows grouped by expert, cumulative ends ``offs``), the four
products of the expert MLP (Qwen3-30B-A3B: 128 experts, D = 2048, I = 768):

- ``fwd gate_up``: ``x [N, D] @ w_gate_up[e]^T`` (``w_gate_up [E, 2I, D]``);
- ``fwd down``: ``a [N, I] @ w_down[e]^T`` (``w_down [E, D, I]``);
- ``dgrad down``: ``g [N, D] @ w_down[e]``;
- ``dgrad gate_up``: ``g [N, 2I] @ w_gate_up[e]``.

Why: torch's CUTLASS grouped GEMM picks its tile from the mean rows per expert (``total rows / experts``) and takes
a 128-row tile unless that mean is 128 or less. At 256 rows per expert (micro-batch 1 of 4,096 tokens, top-8 of 128
experts) an expert with 257-384 rows costs three row tiles: about half of them do, so ~20% of the tiles' rows are
padding. A 64-row tile wastes ~11% there. Whether a Triton kernel with 64-row tiles is faster than CUTLASS with
128-row ones is what this measures.

The Triton kernel: one program per (row tile, column tile); the row tiles of all experts are numbered in expert
order (each expert ``cdiv(rows_e, BLOCK_M)`` of them, counted on the device from ``offs``, no host sync), the grid is
their upper bound ``cdiv(N, BLOCK_M) + E`` and the programs past the last tile return. ``a`` and ``out`` are read and
written through descriptors made on the device per expert (first row, row count: TMA zero-fills the rows past the
expert's last on load and drops them on store), ``B`` through one descriptor over all experts' weights.

Every variant is checked against a float32 reference before its time (``do_bench`` median, ms per launch) is
printed. Routing as ``wgrad_tma.py``: top-8 of uniform random scores (``--balanced``: exactly equal rows per
expert, where CUTLASS's 128-row tiles waste nothing).
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

E, TOPK, D, INTER = 128, 8, 2048, 768
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
SWEEP = (
    (64, 256, 64, 4, 4),
    (64, 256, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
)
CPU_SWEEP = ((16, 32, 16, 4, 2), (32, 16, 32, 4, 2))


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    offs_ptr,
    N_OUT,
    K,
    stride_a,
    stride_out,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    W_NT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[rows_e] = a[rows_e] @ (W_NT ? w[e]^T : w[e])``; ``w`` is ``[E, N_OUT, K]`` (NT) or ``[E, K, N_OUT]``."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N_OUT, BLOCK_N)
    t = pid // tiles_n
    n0 = (pid % tiles_n) * BLOCK_N
    # this row tile's expert: the row tiles of the experts before it, counted from the offsets
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0).to(tl.int32)
    ends = tl.where(idx < E, ends, tl.max(ends, axis=0))
    starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0).to(tl.int32)
    starts = tl.where(idx < E, starts, ends)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    tile_ends = tl.cumsum(tiles, axis=0)
    if t >= tl.max(tile_ends, axis=0):
        return
    e = tl.sum((tile_ends <= t).to(tl.int32), axis=0)
    first_tile = tl.sum(tl.where(idx == e, tile_ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(idx == e, starts, 0), axis=0)
    n_rows = tl.sum(tl.where(idx == e, ends - starts, 0), axis=0)
    m0 = (t - first_tile) * BLOCK_M
    a_desc = tl.make_tensor_descriptor(
        a_ptr + start.to(tl.int64) * stride_a, shape=[n_rows, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K]
    )
    o_desc = tl.make_tensor_descriptor(
        out_ptr + start.to(tl.int64) * stride_out, shape=[n_rows, N_OUT], strides=[stride_out, 1],
        block_shape=[BLOCK_M, BLOCK_N],
    )  # fmt: skip
    if W_NT:
        w_desc = tl.make_tensor_descriptor(
            w_ptr + e.to(tl.int64) * N_OUT * K, shape=[N_OUT, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
    else:
        w_desc = tl.make_tensor_descriptor(
            w_ptr + e.to(tl.int64) * N_OUT * K, shape=[K, N_OUT], strides=[N_OUT, 1], block_shape=[BLOCK_K, BLOCK_N]
        )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k0])
        if W_NT:
            b = tl.trans(w_desc.load([n0, k0]))
        else:
            b = w_desc.load([k0, n0])
        acc = tl.dot(a, b, acc)
    o_desc.store([m0, n0], acc.to(o_desc.dtype))


def grouped_mm_triton(a_NK, w, offs_E, *, nt: bool, cfg) -> torch.Tensor:
    bm, bn, bk, warps, stages = cfg
    n_exp = w.shape[0]
    n_out = w.shape[1] if nt else w.shape[2]
    K = a_NK.shape[1]
    out = torch.empty(a_NK.shape[0], n_out, dtype=a_NK.dtype, device=a_NK.device)
    grid = ((triton.cdiv(a_NK.shape[0], bm) + n_exp) * triton.cdiv(n_out, bn),)
    _grouped_mm_kernel[grid](
        a_NK, w, out, offs_E, n_out, K, a_NK.stride(0), out.stride(0), E=n_exp,
        E_POW2=triton.next_power_of_2(n_exp), W_NT=nt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


def with_empty_groups(b_EKN: torch.Tensor, offs_E: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same grouped product as ``r * (E - 1) + 1`` groups: expert ``e`` is group ``r * e``, the ``r - 1`` after
    each expert but the last have no rows. ``grouped_mm`` picks its tile from ``rows / groups``; its small tile
    (64 x 128 x 128, ping-pong) is taken where that is 128 or less. The weights as a view (expert stride divided by
    ``r``: an empty group's weight is a slice of its expert's, never read), the offsets repeated to match."""
    if b_EKN.stride(0) % r:
        raise ValueError(f"the experts' stride {b_EKN.stride(0)} is not a multiple of {r}")
    n_exp, k, n = b_EKN.shape
    st = b_EKN.stride()
    groups = r * (n_exp - 1) + 1
    b = b_EKN.as_strided((groups, k, n), (st[0] // r, st[1], st[2]))
    return b, offs_E.repeat_interleave(r)[:groups]


def _reference(a, w, offs, nt):
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    out = torch.zeros(a.shape[0], w.shape[1] if nt else w.shape[2], dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(zip(starts, ends)):
        out[s:t] = a[s:t].float() @ (w[e].float().T if nt else w[e].float())
    return out


def _check(got, want):
    got = got.float()
    ok = bool(torch.isfinite(got).all()) and bool(((got - want).abs() <= want.abs() * 2**-7 + 2e-2).all())
    return ok, ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _allocator(device):
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def _products(dev, dtype, tokens, balanced, d=D, inter=INTER, n_exp=E, topk=TOPK):
    """``name -> (a, w, offs, nt)`` for the four products, one routing."""
    n = tokens * topk
    if balanced:
        counts = torch.full((n_exp,), n // n_exp, dtype=torch.int64)
    else:
        ids = torch.rand(tokens, n_exp).topk(topk, dim=1).indices
        counts = torch.bincount(ids.flatten(), minlength=n_exp)
    offs = counts.cumsum(0).to(torch.int32).to(dev)
    w_gu = torch.randn(n_exp, 2 * inter, d, device=dev, dtype=dtype) * 0.02
    w_dn = torch.randn(n_exp, d, inter, device=dev, dtype=dtype) * 0.02
    return {
        "fwd gate_up": (torch.randn(n, d, device=dev, dtype=dtype), w_gu, offs, True),
        "fwd down": (torch.randn(n, inter, device=dev, dtype=dtype), w_dn, offs, True),
        "dgrad down": (torch.randn(n, d, device=dev, dtype=dtype), w_dn, offs, False),
        "dgrad gate_up": (torch.randn(n, 2 * inter, device=dev, dtype=dtype), w_gu, offs, False),
    }


def cpu_check() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-check runs under triton's interpreter: set TRITON_INTERPRET=1")
    from moeshard.ep.testing import interpreter_numpy_fix

    interpreter_numpy_fix()
    _allocator("cpu")
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 37, 16, 19])  # a partial tile, an empty expert, several tiles, exact tiles
    offs = counts.cumsum(0).to(torch.int32)
    n, d, inter = int(offs[-1]), 40, 24
    w_gu, w_dn = torch.randn(5, 2 * inter, d), torch.randn(5, d, inter)
    cases = {
        "nt": (torch.randn(n, d), w_gu, True),
        "nn": (torch.randn(n, d), w_dn, False),
    }
    failed = []
    for name, (a, w, nt) in cases.items():
        want = _reference(a, w, offs, nt)
        for cfg in CPU_SWEEP:
            ok, err = _check(grouped_mm_triton(a, w, offs, nt=nt, cfg=cfg), want)
            print(f"{name} {cfg} {'ok' if ok else 'FAILED'} rel err {err:.1e}")
            if not ok:
                failed.append((name, cfg))
    if failed:
        raise SystemExit(f"FAILED: {failed}")
    print("all variants match the float32 reference (interpreted)")


def _row(at: str, flop: int, label: str, ms: float, err: float) -> None:
    print(f"{at} {label:<28} {ms:7.3f} {flop / ms / 1e9:7.0f} {err:8.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--tokens", default="4096,8192,16384", help="tokens per micro-batch (x8 / 128 = rows per expert)")
    p.add_argument("--no-triton", action="store_true", help="time grouped_mm only (with and without empty groups)")
    p.add_argument(
        "--balanced",
        action="store_true",
        help="equal rows per expert only (default: random routing and equal rows, both timed)",
    )
    args = p.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    dev = torch.device("cuda")
    _allocator(dev)
    torch.manual_seed(0)
    bench = functools.partial(triton.testing.do_bench, warmup=20, rep=80, return_mode="median")
    print(f"{'rows':>5} {'routing':>8} {'product':>13} {'variant':<28} {'ms':>7} {'TFLOP/s':>7} {'rel err':>8}")
    best = {}
    for tokens in map(int, args.tokens.split(",")):
        for balanced in (False, True) if not args.balanced else (True,):
            routing = "balanced" if balanced else "random"
            for name, (a, w, offs, nt) in _products(dev, torch.bfloat16, tokens, balanced).items():
                rows = tokens * TOPK // E
                flop = 2 * a.shape[0] * a.shape[1] * (w.shape[1] if nt else w.shape[2])
                want = _reference(a, w, offs, nt)
                b = w.transpose(-2, -1) if nt else w

                at = f"{rows:>5} {routing:>8} {name:>13}"
                row = functools.partial(_row, at, flop)

                gmm = functools.partial(F.grouped_mm, a, b, offs=offs)
                ms = bench(gmm)
                row("grouped_mm", ms, _check(gmm(), want)[1])
                key = (rows, routing, name)
                best[key] = {"grouped_mm": ms}
                for r in (2, 3, 4, 5, 8, 9):
                    if rows // r < 64 or b.stride(0) % r:
                        continue
                    b_r, offs_r = with_empty_groups(b, offs, r)
                    fn = functools.partial(F.grouped_mm, a, b_r, offs=offs_r)
                    ok, err = _check(fn(), want)
                    label = f"grouped_mm, {r}x groups"
                    if not ok:
                        print(f"{at} {label:<28} FAILED (rel err {err:.1e})")
                        continue
                    ms = bench(fn)
                    row(label, ms, err)
                    if ms < best[key].get("groups", (None, 1e9))[1]:
                        best[key]["groups"] = (label, ms)
                for cfg in () if args.no_triton else SWEEP:
                    fn = functools.partial(grouped_mm_triton, a, w, offs, nt=nt, cfg=cfg)
                    label = "triton {}x{}x{} w{} s{}".format(*cfg)
                    try:
                        ok, err = _check(fn(), want)
                    except Exception as ex:  # a tile that does not fit: say so, go on
                        print(f"{at} {label:<28} failed: {type(ex).__name__}")
                        continue
                    if not ok:
                        print(f"{at} {label:<28} FAILED (rel err {err:.1e})")
                        continue
                    ms = bench(fn)
                    row(label, ms, err)
                    if ms < best[key].get("triton", (None, 1e9))[1]:
                        best[key]["triton"] = (label, ms)
    print("\nbest per product: grouped_mm against the best Triton tile")
    for (rows, routing, name), b in best.items():
        label, ms = b.get("triton", ("-", float("nan")))
        glabel, gms = b.get("groups", ("-", float("nan")))
        print(
            f"{rows:>5} {routing:>8} {name:>13} grouped_mm {b['grouped_mm']:7.3f}  {glabel} {gms:7.3f}  "
            f"triton {ms:7.3f} ({label})"
        )


if __name__ == "__main__":
    main()
