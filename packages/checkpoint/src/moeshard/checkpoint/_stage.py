"""Host copies of a job's state for checkpoint writes: buffers allocated once and reused, filled on a side stream.

:class:`Stager` is a ``torch.distributed.checkpoint`` ``AsyncStager``. Its first :meth:`~Stager.stage` (or
:meth:`~Stager.allocate`, after the first training step) allocates one host tensor per state tensor, of exactly its
size (on CUDA page-locked in place with ``cudaHostRegister``: no rounding up, as torch's pinned cache does); every
later save copies into the same buffers. On CUDA the device→host copies run on a side stream, ordered after the
work that produced the state (the side stream waits for the compute stream) and overlapping the next steps'
forward and backward; :meth:`~Stager.wait_staged` makes the compute stream (not the host) wait for the copies
before the optimizer step overwrites what they read. On the CPU the copy is a plain ``copy_`` in the caller.

The staged tensors own their storage (nothing is a view of a larger buffer), so DCP's ``FileSystemWriter`` writes
them as they are, without the copy it makes of a view.

A float32 master held split (``moeshard.fsdp_moe.SplitMaster``, from ``model_state(..., masters="split")``) is
staged as the float32 tensor it stands for: on CUDA each is joined on the side stream into one scratch tensor (the
size of the largest such piece, reused from one master to the next) and copied from there, so a save never holds
more than one joined master on the device; on the CPU it is joined into its host buffer.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from moeshard.fsdp_moe import SplitMaster

_PIN_MIN_BYTES = 1 << 20  # smaller tensors (scalars, norms) copy as fast unpinned


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece, the tensor holding this rank's values (written into in place when staging into a
    DTensor buffer); any other tensor as it is. ``to_local`` outside autograd: no graph node, no view."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: DTensors count their local piece, a split master the
    float32 tensor it stands for."""
    if isinstance(state, SplitMaster):
        return math.prod(state.local_shape) * 4
    if isinstance(state, DTensor):
        local = local_piece(state)
        return local.numel() * local.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def _split_masters(state: Any):
    """The :class:`SplitMaster` entries of a nested state dict."""
    if isinstance(state, SplitMaster):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _split_masters(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _split_masters(v)


class Stager(AsyncStager):
    """Reusable staging of a state dict into host memory (pinned on CUDA), for :func:`save_checkpoint` and
    :func:`start_async_save`; one per job, kept across saves.

    Args:
        device: the job's device; CUDA stages on a side stream into page-locked buffers, else a copy in the caller.
        pinned: page-lock the buffers (CUDA only; faster copies, host memory that cannot be swapped).
    """

    # DCP's protocol: stage() returns a Future on CUDA; nothing to synchronise after async_save's call.
    _synchronize_after_execute = False

    def __init__(self, device: torch.device, *, pinned: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.pinned = pinned and self.cuda
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._registered: list[int] = []
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._event: torch.cuda.Event | None = None
        self._scratch: torch.Tensor | None = None  # split masters are joined here on CUDA, during stage()
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moeshard-stage") if self.cuda else None
        )
        self.allocated_bytes = 0

    # ---- buffers --------------------------------------------------------------------------------------------------

    def allocate(self, state: dict[str, Any]) -> int:
        """Allocate (or check) the buffers for ``state`` now, e.g. after the first training step (before it the
        optimizer has no state to stage): the first save then copies only. Returns the bytes of host memory the
        buffers hold."""
        self._walk(state, (), copy_into=False)
        return self.allocated_bytes

    def _buffer(self, path: tuple, t: torch.Tensor | SplitMaster) -> torch.Tensor:
        """The host buffer for the tensor (its local piece for a DTensor; the float32 tensor a split master stands
        for) at ``path``; a new one when the shape or dtype changed."""
        buf = self._buffers.get(path)
        like = t.hi if isinstance(t, SplitMaster) else t  # the layout (a DTensor's spec) to copy
        shape = t.local_shape if isinstance(t, SplitMaster) else local_piece(t).shape
        dtype = t.dtype
        held = None if buf is None else local_piece(buf)
        if held is not None and held.shape == shape and held.dtype == dtype:
            return buf
        if isinstance(like, DTensor):
            # torch's own way (``_create_cpu_state_dict``): a CPU DTensor of the same spec, its local piece a copy
            # of exactly its size; made once, so its copy costs nothing per save.
            buf = like.detach().to("cpu", dtype=dtype, copy=True)  # copy: a CPU state's buffer must never alias it
            target = local_piece(buf)
        else:
            buf = target = torch.empty(shape, dtype=dtype)
        nbytes = target.numel() * target.element_size()
        if self.pinned and nbytes >= _PIN_MIN_BYTES:
            err = torch.cuda.cudart().cudaHostRegister(target.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"page-locking {nbytes} bytes of staging memory failed (cudaError {int(err)})")
            self._registered.append(target.data_ptr())
        if held is not None:
            self.allocated_bytes -= held.numel() * held.element_size()
            if held.data_ptr() in self._registered:
                torch.cuda.cudart().cudaHostUnregister(held.data_ptr())
                self._registered.remove(held.data_ptr())
        self.allocated_bytes += nbytes
        self._buffers[path] = buf
        return buf

    def _walk(self, obj: Any, path: tuple, *, copy_into: bool) -> Any:
        """A copy of ``obj`` whose tensors are the host buffers (filled when ``copy_into``); other values copied."""
        if isinstance(obj, SplitMaster):
            buf = self._buffer(path, obj)
            if copy_into:
                dst = local_piece(buf)
                hi = local_piece(obj.hi)
                if not hi.is_cuda:
                    obj.join_into(dst)  # in the host buffer itself
                elif self._scratch is None:  # device halves given to a stager of the CPU: joined, then copied
                    dst.copy_(obj.join_into(torch.empty(dst.shape, dtype=torch.float32, device=hi.device)))
                else:  # joined into the scratch (on the side stream, after the previous master's copy out of it)
                    out = self._scratch[: dst.numel()].view(dst.shape)
                    obj.join_into(out)
                    dst.copy_(out, non_blocking=True)
            return buf
        if isinstance(obj, torch.Tensor):
            buf = self._buffer(path, obj)
            if copy_into:
                src = local_piece(obj)
                dst = local_piece(buf)
                if self.cuda and src.is_cuda:
                    src.record_stream(self._stream)  # not reused by the allocator while the copy is pending
                dst.copy_(src.detach(), non_blocking=self.cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self._walk(v, (*path, k), copy_into=copy_into) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self._walk(v, (*path, i), copy_into=copy_into) for i, v in enumerate(obj)]
            return tuple(out) if isinstance(obj, tuple) else out
        return copy.deepcopy(obj)  # hyper-parameters, names: the values of this moment

    # ---- DCP's AsyncStager ----------------------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        """The host copy of ``state_dict``: a Future of it on CUDA (done when the copies ended), else the copy."""
        if not self.cuda:
            return self._walk(state_dict, (), copy_into=True)
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # after the optimizer step that made this state, without a host wait
        largest = max((math.prod(m.local_shape) for m in _split_masters(state_dict)), default=0)
        if largest:
            # Allocated on the compute stream, so that once the side stream's copies out of it ran it is the
            # compute stream's memory again (not held by the side stream's pool).
            self._scratch = torch.empty(largest, dtype=torch.float32, device=self.device)
            self._scratch.record_stream(self._stream)
        try:
            with torch.cuda.stream(self._stream):
                staged = self._walk(state_dict, (), copy_into=True)
        finally:
            self._scratch = None
        event = torch.cuda.Event()
        event.record(self._stream)
        self._event = event

        def done() -> dict[str, Any]:
            event.synchronize()
            return staged

        return self._pool.submit(done)

    def wait_staged(self) -> None:
        """Make the compute stream wait for the copies of the last :meth:`stage` before anything there overwrites
        the state (the optimizer step); the host does not wait. Nothing to do on the CPU (the copy was made)."""
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    def synchronize_staging(self) -> None:
        """DCP's older protocol; :meth:`stage` returns a Future instead."""

    def close(self) -> None:
        """Kept for the next save: torch 2.11's ``async_save`` closes the stager it was given at each save's end.
        :meth:`release` frees the buffers."""

    def release(self) -> None:
        """Free the buffers (unregistering the page-locked ones) and the copy thread; the stager allocates again on
        its next use."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self._buffers.clear()
        self.allocated_bytes = 0
        self._event = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moeshard-stage")
