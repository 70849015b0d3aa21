"""TMA variants of ``moeshard.ep._wgrad_triton``'s accumulating kernel (Hopper), timed against it.

    source benchmarks/gpu_env.sh && python3 benchmarks/wgrad_tma.py
    TRITON_INTERPRET=1 python3 benchmarks/wgrad_tma.py --cpu-check   # logic only, tiny shapes, no GPU
    python3 benchmarks/wgrad_tma.py --only shipped,tma_pers            # some variants only (label prefixes)

``out[e] += a[rows_e]^T @ b[rows_e]`` (bf16, float32 sums) with the row tiles of ``a`` and ``b`` read by TMA:

- ``tma_host``: host-side descriptors over all of ``a [N, M]`` and ``b [N, K]``. TMA zero-fills only rows past
  ``N``, not the next expert's, so the loop runs over the expert's full ``BLOCK_R`` blocks unmasked and one masked
  tail block (rows ``>= end`` zeroed with ``tl.where``) follows it;
- ``tma_dev``: descriptors made on the device per expert (``tl.make_tensor_descriptor`` at the expert's first row,
  shape = its row count), so the hardware zero-fills the tail and no iteration is masked.

- ``tma_early``: ``tma_dev`` with the old gradient tile read before the row loop (by pointers, used after it, or as
  the accumulator's first value), so that its latency overlaps the loop's GEMMs rather than follow them;
- ``tma_pers``: persistent, the shipped kernel's device descriptors (the output's too) in a loop over tiles by a
  fixed number of programs per SM, with ``tl.range(..., flatten=True)`` (``flat``) or without: whether pipelining
  the tile loop and the row loop as one hides the epilogue of the short row loops.

Each of the first two with the old gradient tile read and the sum written through a 3-d ``[E, M, K]`` descriptor (``tma`` out) or
through pointers (``ptr`` out), and with ``tl.range(..., warp_specialize=True)`` on the row loop (``ws``: Triton's
docs give it for Blackwell only; on sm_90 the loop goes to Triton's Hopper pass, which may fail to compile it or
leave it as it is: the table says which, from the compiled TTGIR).

Shapes and checks as ``benchmarks/wgrad_variants.py``: 128 experts, top-8 of random scores, 256 and 512 rows per
expert, gate/up ``[E, 1536, 2048]`` and down ``[E, 2048, 768]``, torch's ``grouped_mm`` (writing only) for scale.
Every variant is checked element-wise against a float32 reference (on a random old gradient, so a tile left
unwritten or not read fails) before its time (``do_bench`` median, ms per launch) is printed, else it prints FAILED.
Ends with the best tile of each variant per shape. ``--cpu-check`` runs every variant under triton's interpreter on
tiny shapes (uneven rows, an empty expert, partial tiles, NaN rows after the last expert) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import sys
import tempfile

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from moeshard.ep._wgrad_triton import grouped_weight_grad

E, TOPK = 128, 8
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
# (BLOCK_M, BLOCK_K, BLOCK_R, num_warps, num_stages, TMA out, warp_specialize)
SWEEP = (
    (128, 128, 32, 4, 4, True, False),
    (128, 128, 32, 4, 4, False, False),
    (128, 128, 32, 4, 3, True, False),
    (128, 128, 32, 4, 5, True, False),
    (128, 128, 32, 8, 4, True, False),
    (64, 128, 32, 4, 4, True, False),
    (128, 64, 32, 4, 4, True, False),
    (128, 128, 64, 4, 3, True, False),
    (128, 256, 32, 8, 4, True, False),
    (128, 256, 64, 8, 3, True, False),
    (128, 256, 64, 8, 3, False, False),
    (256, 128, 64, 8, 3, True, False),
    (128, 128, 32, 4, 4, True, True),
    (128, 128, 64, 4, 3, True, True),
)
# persistent: (BLOCK_M, BLOCK_K, BLOCK_R, num_warps, num_stages, programs per SM, flatten)
PERS_SWEEP = (
    (128, 128, 32, 4, 4, 1, True),
    (128, 128, 32, 4, 4, 2, True),
    (128, 128, 32, 4, 3, 2, True),
    (128, 128, 64, 4, 3, 2, True),
    (128, 256, 32, 8, 3, 1, True),
    (128, 128, 32, 4, 4, 2, False),
)
CPU_PERS_SWEEP = ((32, 32, 16, 4, 2, 1, True), (32, 32, 16, 4, 2, 1, False))
# the old gradient tile read before the row loop: (BLOCK_M, BLOCK_K, BLOCK_R, num_warps, num_stages, how)
EARLY_SWEEP = (
    (128, 128, 32, 4, 4, "ptr"),
    (128, 128, 32, 4, 3, "ptr"),
    (128, 128, 64, 4, 3, "ptr"),
    (128, 128, 32, 8, 4, "ptr"),
    (128, 128, 32, 4, 4, "init"),
    (128, 128, 32, 4, 3, "init"),
    (128, 128, 64, 8, 3, "init"),
    (128, 256, 32, 8, 3, "init"),
)
CPU_EARLY_SWEEP = ((32, 32, 16, 4, 2, "ptr"), (32, 32, 16, 4, 2, "init"))
CPU_SWEEP = (
    (32, 32, 16, 4, 2, True, False),
    (32, 32, 16, 4, 2, False, False),
    (16, 32, 32, 4, 2, True, True),
)


@triton.jit
def _add_into(
    acc, out_desc, out_ptr, e, m0, k0, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TMA_OUT: tl.constexpr
):
    """``out[e, m0:, k0:] += acc`` (one rounding), by the ``[E, M, K]`` descriptor or by masked pointers."""
    dtype = out_ptr.dtype.element_ty
    if TMA_OUT:
        old = out_desc.load([e, m0, k0]).reshape(BLOCK_M, BLOCK_K)
        new = acc + old.to(tl.float32)
        out_desc.store([e, m0, k0], new.to(dtype).reshape(1, BLOCK_M, BLOCK_K))
    else:
        rm = m0 + tl.arange(0, BLOCK_M)
        rk = k0 + tl.arange(0, BLOCK_K)
        ptr = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
        mask = (rm < M)[:, None] & (rk < K)[None, :]
        tl.store(ptr, (acc + tl.load(ptr, mask=mask, other=0.0).to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _expert_rows(offs_ptr, e):
    end = tl.load(offs_ptr + e).to(tl.int32)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int32), 0)
    return start, end


@triton.jit
def _tma_host(
    a_desc,
    b_desc,
    out_desc,
    out_ptr,
    offs_ptr,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TMA_OUT: tl.constexpr,
    WS: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (pid // tiles_k) * BLOCK_M
    k0 = (pid % tiles_k) * BLOCK_K
    start, end = _expert_rows(offs_ptr, e)
    n_full = (end - start) // BLOCK_R
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for i in tl.range(0, n_full, warp_specialize=WS):
        r = start + i * BLOCK_R
        acc = tl.dot(tl.trans(a_desc.load([r, m0])), b_desc.load([r, k0]), acc)
    r = start + n_full * BLOCK_R
    if r < end:  # the tail: the descriptor reads on into the next expert's rows, zero them
        keep = (r + tl.arange(0, BLOCK_R) < end)[:, None]
        a = a_desc.load([r, m0])
        b = b_desc.load([r, k0])
        a = tl.where(keep, a, tl.zeros_like(a))
        b = tl.where(keep, b, tl.zeros_like(b))
        acc = tl.dot(tl.trans(a), b, acc)
    _add_into(acc, out_desc, out_ptr, e, m0, k0, M, K, BLOCK_M, BLOCK_K, TMA_OUT)


@triton.jit
def _tma_dev(
    a_ptr,
    b_ptr,
    out_desc,
    out_ptr,
    offs_ptr,
    M,
    K,
    stride_a,
    stride_b,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    TMA_OUT: tl.constexpr,
    WS: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (pid // tiles_k) * BLOCK_M
    k0 = (pid % tiles_k) * BLOCK_K
    start, end = _expert_rows(offs_ptr, e)
    n = end - start
    # the expert's rows as tensors of their own: TMA zero-fills rows >= n (an empty expert: 1 row, never read)
    a_desc = tl.make_tensor_descriptor(
        a_ptr + start.to(tl.int64) * stride_a,
        shape=[tl.maximum(n, 1), M],
        strides=[stride_a, 1],
        block_shape=[BLOCK_R, BLOCK_M],
    )
    b_desc = tl.make_tensor_descriptor(
        b_ptr + start.to(tl.int64) * stride_b,
        shape=[tl.maximum(n, 1), K],
        strides=[stride_b, 1],
        block_shape=[BLOCK_R, BLOCK_K],
    )
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r in tl.range(0, n, BLOCK_R, warp_specialize=WS):
        acc = tl.dot(tl.trans(a_desc.load([r, m0])), b_desc.load([r, k0]), acc)
    _add_into(acc, out_desc, out_ptr, e, m0, k0, M, K, BLOCK_M, BLOCK_K, TMA_OUT)


@triton.jit
def _tma_pers(
    a_ptr,
    b_ptr,
    out_ptr,
    offs_ptr,
    E,
    M,
    K,
    stride_a,
    stride_b,
    PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Persistent: ``PROGS`` programs walk the tiles (expert-major, so a wave shares an expert's rows in L2); with
    ``FLATTEN`` the row loop and the tile loop are pipelined as one, so the next tile's first loads overlap this
    tile's epilogue (the short row loops at 256-512 rows per expert leave the epilogue exposed otherwise)."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_e = tl.cdiv(M, BLOCK_M) * tiles_k
    for tile in tl.range(tl.program_id(0), per_e * E, PROGS, flatten=FLATTEN):
        e = tile // per_e
        t = tile % per_e
        m0 = (t // tiles_k) * BLOCK_M
        k0 = (t % tiles_k) * BLOCK_K
        start, end = _expert_rows(offs_ptr, e)
        n = end - start
        a_desc = tl.make_tensor_descriptor(
            a_ptr + start.to(tl.int64) * stride_a, shape=[tl.maximum(n, 1), M], strides=[stride_a, 1],
            block_shape=[BLOCK_R, BLOCK_M],
        )  # fmt: skip
        b_desc = tl.make_tensor_descriptor(
            b_ptr + start.to(tl.int64) * stride_b, shape=[tl.maximum(n, 1), K], strides=[stride_b, 1],
            block_shape=[BLOCK_R, BLOCK_K],
        )  # fmt: skip
        o_desc = tl.make_tensor_descriptor(
            out_ptr + e.to(tl.int64) * M * K, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for r in range(0, n, BLOCK_R):
            acc = tl.dot(tl.trans(a_desc.load([r, m0])), b_desc.load([r, k0]), acc)
        acc += o_desc.load([m0, k0]).to(tl.float32)
        o_desc.store([m0, k0], acc.to(o_desc.dtype))


@triton.jit
def _tma_early(
    a_ptr,
    b_ptr,
    out_desc,
    out_ptr,
    offs_ptr,
    M,
    K,
    stride_a,
    stride_b,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INIT: tl.constexpr,
):
    """``tma_dev`` with the old gradient tile read before the row loop, so its latency overlaps the loop's GEMMs:
    by pointers into registers that the loop does not touch (``ptr``: an ordinary load only waits where its value
    is used, after the loop), or by the output descriptor as the accumulator's starting value (``init``)."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (pid // tiles_k) * BLOCK_M
    k0 = (pid % tiles_k) * BLOCK_K
    start, end = _expert_rows(offs_ptr, e)
    n = end - start
    a_desc = tl.make_tensor_descriptor(
        a_ptr + start.to(tl.int64) * stride_a, shape=[tl.maximum(n, 1), M], strides=[stride_a, 1],
        block_shape=[BLOCK_R, BLOCK_M],
    )  # fmt: skip
    b_desc = tl.make_tensor_descriptor(
        b_ptr + start.to(tl.int64) * stride_b, shape=[tl.maximum(n, 1), K], strides=[stride_b, 1],
        block_shape=[BLOCK_R, BLOCK_K],
    )  # fmt: skip
    rm = m0 + tl.arange(0, BLOCK_M)
    rk = k0 + tl.arange(0, BLOCK_K)
    ptr = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    if INIT:
        acc = out_desc.load([e, m0, k0]).reshape(BLOCK_M, BLOCK_K).to(tl.float32)
    else:
        old = tl.load(ptr, mask=mask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for r in range(0, n, BLOCK_R):
        acc = tl.dot(tl.trans(a_desc.load([r, m0])), b_desc.load([r, k0]), acc)
    if not INIT:
        acc += old.to(tl.float32)
    out_desc.store([e, m0, k0], acc.to(out_desc.dtype).reshape(1, BLOCK_M, BLOCK_K))


def _run_early(cfg, a, b, offs, out):
    bm, bk, br, warps, stages, how = cfg
    n_exp, M, K = out.shape
    out_desc = TensorDescriptor.from_tensor(out, [1, bm, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk), n_exp)
    return _tma_early[grid](
        a, b, out_desc, out, offs, M, K, a.stride(0), b.stride(0), BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br,
        INIT=how == "init", num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _run_tma(variant, cfg, a, b, offs, out):
    """One launch of ``variant`` ("tma_host" / "tma_dev") adding into ``out``; returns the compiled kernel."""
    bm, bk, br, warps, stages, tma_out, ws = cfg
    n_exp, M, K = out.shape
    # TMA: 16-byte aligned bases and row strides (bf16: M and K multiples of 8)
    assert a.stride(1) == b.stride(1) == 1 and out.is_contiguous()
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    assert (a.stride(0) * a.element_size()) % 16 == 0 and (b.stride(0) * b.element_size()) % 16 == 0
    assert (K * out.element_size()) % 16 == 0
    out_desc = TensorDescriptor.from_tensor(out, [1, bm, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk), n_exp)
    kw = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, TMA_OUT=tma_out, WS=ws, num_warps=warps, num_stages=stages)
    if variant == "tma_host":
        a_desc = TensorDescriptor.from_tensor(a, [br, bm])
        b_desc = TensorDescriptor.from_tensor(b, [br, bk])
        return _tma_host[grid](a_desc, b_desc, out_desc, out, offs, M, K, **kw)
    return _tma_dev[grid](a, b, out_desc, out, offs, M, K, a.stride(0), b.stride(0), **kw)


def _run_pers(cfg, a, b, offs, out):
    bm, bk, br, warps, stages, per_sm, flatten = cfg
    n_exp, M, K = out.shape
    sms = torch.cuda.get_device_properties(out.device).multi_processor_count if out.is_cuda else 4
    progs = sms * per_sm
    return _tma_pers[(progs,)](
        a, b, out, offs, n_exp, M, K, a.stride(0), b.stride(0), PROGS=progs, BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br,
        FLATTEN=flatten, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _label(variant, cfg):
    bm, bk, br, warps, stages, tma_out, ws = cfg
    return f"{variant} {bm}x{bk}x{br} w{warps} s{stages} {'tma' if tma_out else 'ptr'}-out{' ws' if ws else ''}"


def _family(label):
    return label.split(" ")[0] + (" ws" if label.endswith(" ws") else "")


def _ws_note(kernel) -> str:
    """Whether the compiler split the kernel into warp-specialised partitions (from its TTGIR)."""
    try:
        ttgir = kernel.asm["ttgir"]
    except (AttributeError, KeyError, TypeError):
        return ""
    return "ws applied" if "ttg.warp_specialize" in ttgir else "ws not applied (no partitions in TTGIR)"


def _variants(a, b, offs, sweep, pers_sweep=PERS_SWEEP, early_sweep=EARLY_SWEEP):
    """Label -> ``fn(out)`` adding ``a[rows_e]^T @ b[rows_e]`` into ``out`` (returning a kernel or None)."""
    runs = {}
    for cfg in early_sweep:
        bm, bk, br, warps, stages, how = cfg
        runs[f"tma_early {bm}x{bk}x{br} w{warps} s{stages} {how}"] = functools.partial(_run_early, cfg, a, b, offs)
    for cfg in pers_sweep:
        bm, bk, br, warps, stages, per_sm, flatten = cfg
        label = f"tma_pers {bm}x{bk}x{br} w{warps} s{stages} x{per_sm}{' flat' if flatten else ''}"
        runs[label] = functools.partial(_run_pers, cfg, a, b, offs)
    for name in ("few_rows", "many_rows"):
        runs[f"shipped {name}"] = functools.partial(_shipped, a, b, offs, config=name)
    for variant in ("tma_host", "tma_dev"):
        for cfg in sweep:
            runs[_label(variant, cfg)] = functools.partial(_run_tma, variant, cfg, a, b, offs)
    return runs


def _shipped(a, b, offs, out, *, config):
    grouped_weight_grad(a, b, offs, out, accumulate=True, config=config)


def _reference(a, b, offs):
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.stack([a[s:e].float().T @ b[s:e].float() for s, e in zip(starts, ends)])


def _check(got, want):
    """``(ok, rel err)``: every element within bf16 rounding of the float32 sum (a missed or extra row is ~1)."""
    got = got.float()
    ok = bool(torch.isfinite(got).all()) and bool(((got - want).abs() <= want.abs() * 2**-7 + 1e-2).all())
    return ok, ((got - want).norm() / want.norm()).item()


def _allocator(device):
    # tl.make_tensor_descriptor writes its descriptors into global scratch that triton asks the host for
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def cpu_check() -> None:
    """Every variant once on tiny uneven shapes under the interpreter: partial M/K tiles, an empty expert, tails."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-check runs under triton's interpreter: set TRITON_INTERPRET=1")
    from moeshard.ep.testing import interpreter_numpy_fix

    interpreter_numpy_fix()
    _allocator("cpu")
    torch.manual_seed(0)
    M, K = 40, 56  # multiples of 8 (TMA's 16-byte strides), not of the blocks
    counts = [5, 0, 37, 16, 19]  # a tail only, empty, 2 full blocks + tail, exactly one block, one block + tail
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    N = int(offs[-1]) + 7  # rows after the last expert's end, poisoned: a kernel reading them gets NaN
    # float32: the interpreter's bf16 dot multiplies the raw bits (the GPU run checks bf16)
    a, b = torch.randn(N, M), torch.randn(N, K)
    a[int(offs[-1]) :] = float("nan")
    b[int(offs[-1]) :] = float("nan")
    old = torch.randn(len(counts), M, K)
    want = old.float() + _reference(a, b, offs)
    failed = []
    for label, fn in _variants(a, b, offs, CPU_SWEEP, CPU_PERS_SWEEP, CPU_EARLY_SWEEP).items():
        o = old.clone()
        fn(o)
        ok, err = _check(o, want)
        print(f"{label:<44} {'ok' if ok else 'FAILED'} rel err {err:.1e}")
        if not ok:
            failed.append(label)
    if failed:
        raise SystemExit(f"FAILED: {', '.join(failed)}")
    print("all variants match the float32 reference (interpreted: float32 operands, TMA's zero fill as the")
    print("interpreter models it, warp_specialize ignored; compiling for sm_90 is left to the GPU run)")


class _Log:
    text = ""


@contextlib.contextmanager
def _stderr_captured():
    """Hold what is written to file descriptor 2 (the compiler's C++ diagnostics and IR dumps); replay it only if
    the block succeeds, so a failed compile costs one line of the table, not a page of IR."""
    log = _Log()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        ok = False
        try:
            yield log
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            log.text = f.read().decode(errors="replace")
            if ok and log.text:
                sys.stderr.write(log.text)


def _first_line(text, width=60):
    return (text.strip().splitlines() or [""])[0][:width]


def _compiler_note(text):
    """The compiler's own reason, when its diagnostics name one: the failing pass and its assertion."""
    notes = []
    for pattern in (r"executing \[`(\w+)`", r"UNREACHABLE executed at \S*/([\w.]+:\d+)", r"^(unsupported [^\n]*)$"):
        m = re.search(pattern, text, re.M)
        if m:
            notes.append(m.group(1))
    return f" ({', '.join(notes)})" if notes else ""


def _rows(tokens, dev):
    ids = torch.rand(tokens, E, device=dev).topk(TOPK, dim=1).indices
    return torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(torch.int32)


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median")


def _time_shape(tokens, wname, M, K, dev, best, failed, only=()) -> None:
    """Print one line per variant at one shape; keep the fastest correct tile of each variant in ``best``."""
    rows = tokens * TOPK // E
    N = tokens * TOPK
    offs = _rows(tokens, dev)
    a = torch.randn(N, M, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    ref = _reference(a, b, offs)
    old = torch.randn(E, M, K, device=dev, dtype=torch.bfloat16)
    want = old.float() + ref

    def row(label, text):
        print(f"{rows:>5} {wname:>7} {label:<44} {text}")

    # torch's CUTLASS grouped GEMM, for scale: writing only, and writing + the separate add
    def gmm():
        return F.grouped_mm(a.T, b, offs=offs)

    ms = _bench(gmm)
    row("grouped_mm (writes, no add)", f"{ms:7.3f} {_check(gmm(), ref)[1]:8.1e}")
    best[(rows, wname, "grouped_mm")] = ("grouped_mm (writes, no add)", ms)
    g = old.clone()
    row("grouped_mm + add", f"{_bench(lambda: g.add_(gmm())):7.3f}")
    for label, fn in _variants(a, b, offs, SWEEP).items():
        if only and not label.startswith(only):
            continue
        if label in failed:  # did not compile at an earlier shape: the same compile again would fail the same way
            row(label, failed[label])
            continue
        o = old.clone()
        try:
            with _stderr_captured() as log:
                kernel = fn(o)
                torch.cuda.synchronize()
        except Exception as ex:  # one that does not compile: say so, go on
            kind = "unsupported" if label.endswith(" ws") else "failed"
            failed[label] = f"{kind}: {type(ex).__name__}: {_first_line(str(ex))}{_compiler_note(log.text)}"
            row(label, failed[label])
            continue
        ok, err = _check(o, want)
        if not ok:
            row(label, f"FAILED (wrong result, rel err {err:.1e})")
            continue
        ms = _bench(functools.partial(fn, old.clone()))
        note = _ws_note(kernel) if label.endswith(" ws") and kernel is not None else ""
        row(label, f"{ms:7.3f} {err:8.1e} {note}".rstrip())
        key = (rows, wname, _family(label))
        if key not in best or ms < best[key][1]:
            best[key] = (label, ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-check", action="store_true", help="check every variant on tiny shapes, interpreted")
    p.add_argument("--tokens", default="4096,8192", help="tokens per micro-batch (x8 / 128 = rows per expert)")
    p.add_argument("--only", default="", help="comma-separated label prefixes of the variants to time (default all)")
    args = p.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)
    print(
        f"{torch.cuda.get_device_name(dev)} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}"
    )
    _allocator(dev)
    torch.manual_seed(0)
    best, failed = {}, {}
    print(f"{'rows':>5} {'weight':>7} {'variant':<44} {'ms':>7} {'rel err':>8}")
    for tokens in map(int, args.tokens.split(",")):
        for wname, (M, K) in SHAPES.items():
            _time_shape(tokens, wname, M, K, dev, best, failed, tuple(filter(None, args.only.split(","))))
    print(f"\nbest tile per variant\n{'rows':>5} {'weight':>7} {'variant':<12} {'ms':>7}  tile")
    for (rows, wname, fam), (label, ms) in best.items():
        print(f"{rows:>5} {wname:>7} {fam:<12} {ms:7.3f}  {label}")


if __name__ == "__main__":
    main()
