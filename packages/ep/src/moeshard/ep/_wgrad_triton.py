"""The experts' weight gradients as one Triton grouped GEMM that can add into the gradient it is given.

# N rows grouped by local expert (cumulative ends ``offs_E``), E local experts, M and K the two weight dims

``out[e] = alpha * a[rows_e]^T @ b[rows_e]`` (``accumulate=False``) or ``out[e] += alpha * a[rows_e]^T @ b[rows_e]``
(``accumulate=True``), for every local expert ``e``, products summed in float32 and the old value added in float32
before the one rounding to ``out``'s dtype. An expert without rows gets zeros (or keeps its gradient).

Why: with gradient accumulation, torch's ``grouped_mm`` writes each micro-batch's weight gradient into a new tensor
and autograd then adds it to ``param.grad`` in a separate pass, reading both and writing one (1.2 GB per
Qwen3-30B-A3B layer). Here the GEMM's epilogue reads the old gradient once and writes the sum once.

A program owns one ``BLOCK_M x BLOCK_K`` tile of one expert's gradient and runs over that expert's rows in
``BLOCK_R`` steps (the reduction dimension is the rows: ``a`` and ``b`` are read row-major, ``a`` transposed in
registers). The expert is the grid's second axis, so the tiles of one expert run together and share its rows in L2.
Runs under triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors too, which is how the CPU tests check it.

On Hopper and later (``tma=None`` picks it for 16-bit CUDA tensors with 16-byte aligned rows) the rows are read by
TMA through descriptors made on the device for each expert (its first row, its row count: the hardware zero-fills
past the expert's last row, so no block is masked), and the old gradient tile is read and the sum written through a
descriptor of ``out`` (faster than the pointer loads at the expert shapes: ``docs/performance.md``). Device descriptors need a scratch allocation per launch, which
triton asks of the allocator of the calling context: the launch runs in a copy of the caller's context with a torch
allocator set, so the caller's own setting is neither needed nor changed.

One launch can also sum several parts, each with its own rows grouped by expert (:func:`grouped_weight_grad_parts`:
a step's micro-batches, formed at once): the program runs over its expert's rows of each part in turn, so the
gradient is written (or read and written) once. :func:`grouped_weight_grad` is its case of one part.
"""

from __future__ import annotations

import contextvars
import functools

import torch
import triton
import triton.language as tl

from moeshard.ep._squares import check_squares

__all__ = ["CONFIGS", "MAX_PARTS", "TMA_CONFIGS", "grouped_weight_grad", "grouped_weight_grad_parts"]

CONFIGS: dict[str, dict[str, int]] = {
    "few_rows": {"BLOCK_M": 128, "BLOCK_K": 128, "BLOCK_R": 32, "num_warps": 4, "num_stages": 4},
    "many_rows": {"BLOCK_M": 128, "BLOCK_K": 256, "BLOCK_R": 64, "num_warps": 8, "num_stages": 3},
}
"""Tile shapes and launch parameters, by name: ``few_rows`` for experts of up to 256 rows (micro-batch 1 of 4,096
tokens at the 30B-A3B expert shapes), ``many_rows`` for more (the timings that chose them: ``docs/performance.md``)."""
TMA_CONFIGS: dict[str, dict[str, int]] = {
    "few_rows": {"BLOCK_M": 128, "BLOCK_K": 128, "BLOCK_R": 32, "num_warps": 4, "num_stages": 4},
    "many_rows": {"BLOCK_M": 128, "BLOCK_K": 128, "BLOCK_R": 32, "num_warps": 4, "num_stages": 3},
}
"""The same for the TMA kernel (the tiles timed fastest at 256 and 512 rows per expert: ``docs/performance.md``)."""
FEW_ROWS = 384
"""Mean rows per expert up to which ``config=None`` picks ``few_rows``."""


MAX_PARTS = 4
"""Parts one launch of :func:`grouped_weight_grad_parts` sums; more are summed by further, accumulating launches."""


@triton.jit
def _part_product(acc, a_ptr, b_ptr, offs_ptr, sa, sb, e, m0, k0, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_R: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """``acc + a[rows_e]^T @ b[rows_e]`` over one part's rows of expert ``e`` (this program's tile)."""
    end = tl.load(offs_ptr + e).to(tl.int32)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)).to(tl.int32), 0)
    if TMA:
        n = end - start
        a_desc = tl.make_tensor_descriptor(
            a_ptr + start.to(tl.int64) * sa, shape=[tl.maximum(n, 1), M], strides=[sa, 1],
            block_shape=[BLOCK_R, BLOCK_M],
        )  # fmt: skip
        b_desc = tl.make_tensor_descriptor(
            b_ptr + start.to(tl.int64) * sb, shape=[tl.maximum(n, 1), K], strides=[sb, 1],
            block_shape=[BLOCK_R, BLOCK_K],
        )  # fmt: skip
        for r in range(0, n, BLOCK_R):
            acc = tl.dot(tl.trans(a_desc.load([r, m0])), b_desc.load([r, k0]), acc, input_precision=PRECISION)
    else:
        start64, end64 = start.to(tl.int64), end.to(tl.int64)
        rm = m0 + tl.arange(0, BLOCK_M)
        rk = k0 + tl.arange(0, BLOCK_K)
        for r0 in range(start64, end64, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            mask_r = rr < end64
            a = tl.load(a_ptr + rr[:, None] * sa + rm[None, :], mask=mask_r[:, None] & (rm < M)[None, :], other=0.0)
            b = tl.load(b_ptr + rr[:, None] * sb + rk[None, :], mask=mask_r[:, None] & (rk < K)[None, :], other=0.0)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _wgrad_parts_kernel(
    a0, b0, o0, sa0, sb0, a1, b1, o1, sa1, sb1, a2, b2, o2, sa2, sb2, a3, b3, o3, sa3, sb3,
    out_ptr, out_desc, sq_ptr, M, K, alpha,
    PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ACCUMULATE: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr, SQUARES: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    m0 = (tl.program_id(0) // tiles_k) * BLOCK_M
    k0 = (tl.program_id(0) % tiles_k) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    acc = _part_product(acc, a0, b0, o0, sa0, sb0, e, m0, k0, M, K, BLOCK_M, BLOCK_K, BLOCK_R, TMA, PRECISION)
    if PARTS > 1:
        acc = _part_product(acc, a1, b1, o1, sa1, sb1, e, m0, k0, M, K, BLOCK_M, BLOCK_K, BLOCK_R, TMA, PRECISION)
    if PARTS > 2:
        acc = _part_product(acc, a2, b2, o2, sa2, sb2, e, m0, k0, M, K, BLOCK_M, BLOCK_K, BLOCK_R, TMA, PRECISION)
    if PARTS > 3:
        acc = _part_product(acc, a3, b3, o3, sa3, sb3, e, m0, k0, M, K, BLOCK_M, BLOCK_K, BLOCK_R, TMA, PRECISION)
    acc = acc * alpha
    rm = m0 + tl.arange(0, BLOCK_M)
    rk = k0 + tl.arange(0, BLOCK_K)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    if TMA:
        if ACCUMULATE:
            acc += out_desc.load([e, m0, k0]).reshape(BLOCK_M, BLOCK_K).to(tl.float32)
        written = acc.to(out_desc.dtype)
        out_desc.store([e, m0, k0], written.reshape(1, BLOCK_M, BLOCK_K))
    else:
        out = out_ptr + e.to(tl.int64) * M * K + rm[:, None] * K + rk[None, :]
        if ACCUMULATE:
            acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
        written = acc.to(out_ptr.dtype.element_ty)
        tl.store(out, written, mask=mask)
    if SQUARES:  # this tile's sum of squares of what it wrote, one float32 per program (summed by the caller)
        w = tl.where(mask, written.to(tl.float32), 0.0)
        tl.store(sq_ptr + e.to(tl.int64) * tl.num_programs(0) + tl.program_id(0), tl.sum(tl.sum(w * w, axis=1), axis=0))


def _allocate_on(device: torch.device, size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=device)  # the caching allocator's blocks: 512-byte aligned


@functools.cache
def _tma_capable(device: torch.device) -> bool:
    if not hasattr(tl, "make_tensor_descriptor"):
        return False
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def _tma_aligned(*tensors: torch.Tensor) -> bool:
    """TMA's rules: 16-byte aligned base addresses and strides (other than the last, which is 1)."""
    return all(
        t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]) for t in tensors
    )


def grouped_weight_grad(
    a_NM: torch.Tensor,
    b_NK: torch.Tensor,
    offs_E: torch.Tensor,
    out_EMK: torch.Tensor,
    *,
    accumulate: bool,
    alpha: float = 1.0,
    config: str | None = None,
    tma: bool | None = None,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[e] (+)= alpha * a[rows_e]^T @ b[rows_e]`` in place (see the module docstring); returns ``out_EMK``.

    ``a_NM`` and ``b_NK`` need unit stride in their last dim; ``offs_E`` holds each expert's cumulative row end
    (int32 or int64, on the rows' device, last entry <= N); ``out_EMK`` is contiguous ``[E, M, K]``. ``config``: a
    name of :data:`CONFIGS` (:data:`TMA_CONFIGS` for the TMA kernel); None picks by the mean rows per expert (no
    device sync: from the row count). ``tma``: the TMA kernel (True; raises where TMA cannot read these tensors), the
    pointer kernel (False), or None: TMA for 16-bit CUDA tensors on compute capability >= 9.0 that TMA can read.
    (:func:`grouped_weight_grad_parts` with one part; ``squares`` as there.)
    """
    parts = [(a_NM, b_NK, offs_E)]
    return _weight_grad_parts("grouped_weight_grad", parts, out_EMK, accumulate, alpha, config, tma, squares)


def grouped_weight_grad_parts(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    out_EMK: torch.Tensor,
    *,
    accumulate: bool,
    alpha: float = 1.0,
    config: str | None = None,
    tma: bool | None = None,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[e] (+)= alpha * Σ_p a_p[rows_p,e]^T @ b_p[rows_p,e]`` in place, for parts ``(a_p, b_p, offs_p)`` that
    each group their own rows by expert (as :func:`grouped_weight_grad` takes one): the micro-batches of one
    gradient, summed in float32 with one rounding per :data:`MAX_PARTS` parts. Returns ``out_EMK``.

    One launch per :data:`MAX_PARTS` parts: a program runs over its expert's rows of each part in turn, so the
    gradient is read (``accumulate``) and written once, whatever the number of rows in the parts. ``config``:
    by the mean rows per expert of all parts together; ``tma``: as :func:`grouped_weight_grad`, for every part.

    ``squares``: a one-element float32 tensor on ``out``'s device, or None. Given, it receives ``Σ out²`` over the
    whole gradient as written (the rounded values, summed in float32 in a fixed order: per tile in the last launch's
    epilogue, then the tiles' sums), so a clipping norm need not read the gradient again."""
    return _weight_grad_parts("grouped_weight_grad_parts", parts, out_EMK, accumulate, alpha, config, tma, squares)


def _weight_grad_parts(name: str, parts, out_EMK, accumulate: bool, alpha: float, config, tma, squares=None):
    if not parts:
        raise ValueError(f"{name} needs at least one part")
    E, M, K = out_EMK.shape
    for a_NM, b_NK, offs_E in parts:
        if a_NM.shape[1] != M or b_NK.shape[1] != K or a_NM.shape[0] != b_NK.shape[0] or offs_E.numel() != E:
            raise ValueError(
                f"{name}: a {tuple(a_NM.shape)}, b {tuple(b_NK.shape)}, {offs_E.numel()} offsets and out "
                f"{tuple(out_EMK.shape)} do not fit out[e] = a[rows_e]^T @ b[rows_e]"
            )
        if a_NM.stride(-1) != 1 or b_NK.stride(-1) != 1 or a_NM.dtype != parts[0][0].dtype:
            raise ValueError(f"{name} needs row-major a and b (of one dtype in every part)")
    if not out_EMK.is_contiguous():
        raise ValueError(f"{name} needs a contiguous out")
    check_squares(name, squares)
    if E == 0 or M * K == 0:
        if squares is not None:
            squares.zero_()
        return out_EMK
    rows = sum(a.shape[0] for a, _, _ in parts)
    if config is None:
        config = "few_rows" if rows <= FEW_ROWS * E else "many_rows"
    a0 = parts[0][0]
    precision = "ieee" if a0.dtype == torch.float32 else "tf32"
    tensors = [t for a, b, _ in parts for t in (a, b)] + [out_EMK]
    readable = _tma_capable(a0.device) and _tma_aligned(*tensors)
    if tma is None:
        tma = readable and a0.is_cuda and a0.dtype in (torch.bfloat16, torch.float16)
    elif tma and not readable:
        raise ValueError(
            f"{name}(tma=True): TMA needs compute capability >= 9.0 and 16-byte aligned tensors and row strides; "
            "pass tma=None to fall back to the pointer kernel"
        )
    cfg = dict((TMA_CONFIGS if tma else CONFIGS)[config])
    offsets = [o if o.dtype == torch.int32 else o.to(torch.int32) for _, _, o in parts]
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"])
    partial = None if squares is None else torch.empty((E, tiles), dtype=torch.float32, device=out_EMK.device)
    last = (len(parts) - 1) // MAX_PARTS * MAX_PARTS
    for first in range(0, len(parts), MAX_PARTS):
        group = [
            (a, b, o) for (a, b, _), o in zip(parts[first : first + MAX_PARTS], offsets[first : first + MAX_PARTS])
        ]
        args = []
        for a, b, o in group + [group[0]] * (MAX_PARTS - len(group)):
            args += [a, b, o, a.stride(0), b.stride(0)]
        sq = partial if first == last else None  # the last launch writes the gradient's final values
        run = functools.partial(
            _launch_parts, args, out_EMK, len(group), accumulate or first > 0, alpha, cfg, tma, precision, sq
        )
        if tma:
            contextvars.copy_context().run(run)
        else:
            run()
    if squares is not None:
        squares.copy_(partial.sum().reshape(squares.shape))
    return out_EMK


def _launch_parts(args, out_EMK, n_parts, accumulate, alpha, cfg, tma, precision, partial=None) -> None:
    E, M, K = out_EMK.shape
    out_desc = out_EMK
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        out_desc = TensorDescriptor.from_tensor(out_EMK, [1, cfg["BLOCK_M"], cfg["BLOCK_K"]])
        triton.set_allocator(functools.partial(_allocate_on, out_EMK.device))  # in the copied context
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(K, cfg["BLOCK_K"]), E)
    _wgrad_parts_kernel[grid](
        *args,
        out_EMK,
        out_desc,
        out_EMK if partial is None else partial,
        M,
        K,
        float(alpha),
        PARTS=n_parts,
        ACCUMULATE=bool(accumulate),
        TMA=bool(tma),
        PRECISION=precision,
        SQUARES=partial is not None,
        **cfg,
    )
