"""Batches prepared ahead: a background thread fills a bounded queue, in step order, pinned when CUDA is there."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import torch

from moeshard.data._dataset import StepBatches
from moeshard.data._packing import Batch

_DONE = object()


class PrefetchLoader:
    """Iterates ``(step, micro_batches)`` of one rank for steps ``[start_step, stop_step)``.

    One producer thread builds the steps in order, up to ``depth`` ahead of the consumer (reading token files and
    numpy work release the GIL, so it overlaps the GPU's work); with ``pin_memory`` (default: when CUDA is
    available) the tensors are in pinned memory, so ``batch.to(device, non_blocking=True)`` is an asynchronous copy.
    The order is deterministic: exactly ``StepBatches.micro_batches(step, rank)``. An error in the producer is
    raised in the consumer. Use as a context manager (or call ``close``) to stop the thread early.
    """

    def __init__(
        self,
        batches: StepBatches,
        rank: int,
        start_step: int,
        stop_step: int,
        *,
        depth: int = 2,
        pin_memory: bool | None = None,
    ):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.batches, self.rank, self.start_step, self.stop_step = batches, rank, start_step, stop_step
        self.pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="moeshard-data-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for step in range(self.start_step, self.stop_step):
                mbs = self.batches.micro_batches(step, self.rank)
                if self.pin:
                    mbs = [b.pin_memory() for b in mbs]
                if not self._put((step, mbs)):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def __iter__(self) -> Iterator[tuple[int, list[Batch]]]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop the producer thread (and wait for it)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> PrefetchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
