"""Triton kernels of the gradients FSDP2 holds in float32 (CUDA; see ``_reduced_grad``): a unit's compute-dtype
gradients added into them (:func:`add_into_float32`, see ``grouped_grad_accumulation``), a scaled float32 gradient
added into a held one (:func:`scaled_add_`, see ``ReducedGrad.add_``) and a gradient scaled in place unless its
factor is one (:func:`scale_`). They also run under triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors,
which is how the CPU tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["add_into_float32", "scale_", "scaled_add_"]

_ADD_BLOCK = 4096


@triton.jit
def _add_into_float32_kernel(table_ptr, n_tensors, HALF: tl.constexpr, T_POW2: tl.constexpr, BLOCK: tl.constexpr):
    # table (int64): destination addresses, source addresses, element counts, each tensor's first block
    pid = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, T_POW2)
    first = tl.load(table_ptr + 3 * n_tensors + idx, mask=idx < n_tensors, other=2**62)
    i = tl.sum((first <= pid).to(tl.int32), axis=0) - 1
    dst = tl.load(table_ptr + i).to(tl.pointer_type(tl.float32))
    if HALF:
        src = tl.load(table_ptr + n_tensors + i).to(tl.pointer_type(tl.float16))
    else:
        src = tl.load(table_ptr + n_tensors + i).to(tl.pointer_type(tl.bfloat16))
    n = tl.load(table_ptr + 2 * n_tensors + i)
    offs = (pid - tl.load(table_ptr + 3 * n_tensors + i)) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    acc = tl.load(dst + offs, mask=inside)
    tl.store(dst + offs, acc + tl.load(src + offs, mask=inside).to(tl.float32), mask=inside)


def add_into_float32(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst += src`` for each pair (float32 ``dst``, bfloat16 or float16 ``src`` of its shape, both contiguous, one
    device): one vectorised kernel per source dtype over all pairs. Torch adds a 16-bit tensor into a float32 one
    with an unvectorised mixed-dtype kernel, one launch per tensor. The tensors' addresses go to the device in one
    small table (a non-blocking copy from pinned memory on CUDA)."""
    by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        ok = d.dtype == torch.float32 and s.dtype in (torch.bfloat16, torch.float16) and d.shape == s.shape
        if not (ok and d.is_contiguous() and s.is_contiguous() and d.device == s.device == dsts[0].device):
            raise ValueError(
                f"add_into_float32 adds contiguous 16-bit tensors into float32 ones of their shape on one device, got "
                f"{s.dtype} {tuple(s.shape)} into {d.dtype} {tuple(d.shape)}"
            )
        if d.numel():
            by_dtype.setdefault(s.dtype, []).append((d, s))
    for dtype, pairs in by_dtype.items():
        blocks = [triton.cdiv(d.numel(), _ADD_BLOCK) for d, _ in pairs]
        firsts = [sum(blocks[:i]) for i in range(len(blocks))]
        rows = [[d.data_ptr() for d, _ in pairs], [s.data_ptr() for _, s in pairs], [d.numel() for d, _ in pairs]]
        device = pairs[0][0].device
        table = torch.tensor(
            [*rows[0], *rows[1], *rows[2], *firsts], dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        table = table.to(device, non_blocking=True)
        _add_into_float32_kernel[(sum(blocks),)](
            table,
            len(pairs),
            HALF=dtype == torch.float16,
            T_POW2=triton.next_power_of_2(len(pairs)),
            BLOCK=_ADD_BLOCK,
            num_warps=8,
        )


@triton.jit
def _scaled_add_kernel(acc_ptr, g_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    factor = tl.load(factor_ptr).to(tl.float32)
    acc = tl.load(acc_ptr + offs, mask=inside)
    g = tl.load(g_ptr + offs, mask=inside)
    tl.store(acc_ptr + offs, acc + g * factor, mask=inside)


def scaled_add_(acc: torch.Tensor, g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``acc += g * factor`` in one pass (float32 ``acc`` and ``g`` of one shape, contiguous; ``factor`` a
    one-element tensor read on the device): a float32 gradient handed over, scaled, added to the one FSDP2 holds
    from earlier micro-batches (the LM head's). Eager torch needs two passes for it (``g *= factor`` vectorised, then
    the add; ``addcmul`` with a one-element device tensor broadcasts and is not vectorised): 6.2 against 3.7 GB per
    micro-batch at the ``[V, D]`` head of Qwen3-30B-A3B. Runs on CUDA tensors, or on CPU ones under triton's
    interpreter (the tests)."""
    if acc.dtype != torch.float32 or g.dtype != torch.float32 or acc.shape != g.shape or factor.numel() != 1:
        raise ValueError(
            f"scaled_add_ needs float32 acc and g of one shape and a one-element factor, got {acc.dtype} "
            f"{tuple(acc.shape)}, {g.dtype} {tuple(g.shape)} and {factor.numel()} factor elements"
        )
    if not (acc.is_contiguous() and g.is_contiguous()):
        raise ValueError("scaled_add_ needs contiguous acc and g")
    n = acc.numel()
    if n:
        _scaled_add_kernel[(triton.cdiv(n, _ADD_BLOCK),)](acc, g, factor, n, BLOCK=_ADD_BLOCK, num_warps=8)
    return acc


@triton.jit
def _scale_kernel(x_ptr, factor_ptr, n, blocks, BLOCK: tl.constexpr):
    # Every program reads the factor first and has nothing to do where it is one; else blocks pid, pid + P, ...
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        zero = tl.program_id(0).to(tl.int64) * 0  # int64 offsets (the interpreter's loop variable is a Python int)
        for b in range(tl.program_id(0), blocks, tl.num_programs(0)):
            offs = (zero + b) * BLOCK + tl.arange(0, BLOCK)
            inside = offs < n
            x = tl.load(x_ptr + offs, mask=inside)
            tl.store(x_ptr + offs, (x.to(tl.float32) * factor).to(x_ptr.dtype.element_ty), mask=inside)


def _programs(device: torch.device) -> int:
    """One wave of 8-warp programs: 8 per SM on CUDA (a fixed 8 in the interpreter)."""
    if device.type != "cuda":
        return 8
    return 8 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def scale_(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x *= factor`` in place (contiguous ``x``; ``factor`` a one-element tensor read on the device, the product
    taken in float32), and no pass over ``x`` where ``factor`` is one: one wave of programs that each read the
    factor and, unless it is one, scale their blocks. A gradient that already holds its scale (the LM head's,
    which folds the loss's divisor into its logit gradient) then costs one launch instead of a read and a write of
    ``x`` (1.24 GB at the float32 ``[V, D]`` head of Qwen3-30B-A3B). Runs on CUDA tensors, or on
    CPU ones under triton's interpreter (the tests)."""
    if factor.numel() != 1 or not x.is_contiguous():
        raise ValueError(
            f"scale_ needs a contiguous tensor and a one-element factor, got {factor.numel()} factor elements and a "
            f"{'contiguous' if x.is_contiguous() else 'non-contiguous'} tensor"
        )
    n = x.numel()
    if n:
        blocks = triton.cdiv(n, _ADD_BLOCK)
        _scale_kernel[(min(blocks, _programs(x.device)),)](x, factor, n, blocks, BLOCK=_ADD_BLOCK, num_warps=8)
    return x
