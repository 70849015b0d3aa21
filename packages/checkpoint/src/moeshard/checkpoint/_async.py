"""A checkpoint written in the background, published like a synchronous one.

The same temporary folder, ``COMPLETE`` record and rename as :func:`moeshard.checkpoint.save_checkpoint`:
:func:`start_async_save` checks the free space, writes the small files and agrees on them at once, stages the
state into the job's :class:`~moeshard.checkpoint.Stager` (reused buffers; on CUDA a side stream overlapping the
next steps) and lets DCP's ``async_save`` write it from a thread; :class:`PendingSave` publishes it only once the
write ended well on every rank, and reports a failed one (:class:`~moeshard.checkpoint.CheckpointSaveError`)
without publishing it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moeshard.checkpoint._checkpoint import (
    DEFAULT_SAVE_OPTIONS,
    Saved,
    SaveOptions,
    WriterFactory,
    _begin,
    _publish,
    _raise_if_any_failed,
    _write_small,
    checkpoint_name,
)
from moeshard.checkpoint._space import check_room_for_save
from moeshard.checkpoint._stage import Stager, state_bytes


class PendingSave:
    """A checkpoint being written in the background: published by rank 0 only once the write finished on every
    rank.

    DCP's save ends with a gather of every rank's write result at rank 0 and a broadcast of the outcome, so a
    successful end on rank 0 means every rank's shard is written: :meth:`publish_if_done` (rank 0, at any step
    end) publishes it without a collective; :meth:`wait` (every rank, at the same step: the next save, the end of
    the run) agrees on the outcome and raises :class:`CheckpointSaveError` for a failed write, never published.
    """

    def __init__(
        self, ckpt_dir: Path, tmp: Path, step: int, keep_last: int, response: Any, stager: Stager, started: float
    ) -> None:
        self.ckpt_dir, self.tmp, self.step, self.keep_last, self.stager = ckpt_dir, tmp, step, keep_last, stager
        # DCP returns a Future, or with background staging an AsyncSaveResponse of two.
        self.upload = getattr(response, "upload_completion", response)
        self.staging = getattr(response, "staging_completion", None)
        self.published: Path | None = None
        self.started = started
        self.blocking_s = time.perf_counter() - started
        self.bytes = 0
        self._staged_at = started + self.blocking_s if self.staging is None else None
        self._written_at: float | None = None
        if self.staging is not None:
            self.staging.add_done_callback(lambda _: setattr(self, "_staged_at", time.perf_counter()))
        self.upload.add_done_callback(lambda _: setattr(self, "_written_at", time.perf_counter()))

    def wait_staged(self) -> None:
        """Call it before anything changes the state (the optimizer step): on CUDA the compute stream waits for
        the copies (the host does not), elsewhere the copy was made at the start. A staging error is left for
        :meth:`wait`."""
        self.stager.wait_staged()

    def publish_if_done(self) -> Path | None:
        """Rank 0: publish the checkpoint when its write has ended well on every rank; its folder once published."""
        if self.published is None and self.upload.done() and self.upload.exception() is None:
            self.published = _publish(self.ckpt_dir, self.tmp, self.step, self.keep_last)
        return self.published

    def wait(self) -> Saved:
        """Every rank: wait for the write, agree on its outcome, publish (rank 0). Returns what the save did (its
        ``blocking_s``: the start's; ``write_s``: from the end of staging to the end of the write).

        Raises:
            CheckpointSaveError: the write failed on some rank; the temporary folder is removed.
        """
        error = None
        try:
            if self.staging is not None:
                self.staging.result()
            self.upload.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises its BaseException on every rank
            error = e
        _raise_if_any_failed(self.ckpt_dir, self.tmp, self.step, error, how=" (in the background)")
        if dist.get_rank() == 0:
            self.publish_if_done()
        dist.barrier()
        return self.times()

    def times(self) -> Saved:
        """What the save did so far (its write time once the write ended)."""
        staged = self._staged_at or time.perf_counter()
        written = self._written_at or time.perf_counter()
        path = self.ckpt_dir / checkpoint_name(self.step)
        return Saved(path, self.step, self.bytes, self.blocking_s, staged - self.started, max(0.0, written - staged))

    def abandon(self) -> None:
        """After an error elsewhere (no collective): wait for this rank's own write; rank 0 publishes it if it ended
        well, else removes the temporary folder."""
        import shutil

        try:
            self.upload.result()
            if dist.get_rank() == 0:
                self.publish_if_done()
        except BaseException:  # noqa: BLE001 - the caller's own error is the one reported
            if dist.get_rank() == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)


def start_async_save(
    ckpt_dir: Path,
    step: int,
    app_state: dict[str, Any],
    extra: dict[str, Any],
    rank_state: dict[str, torch.Tensor],
    *,
    keep_last: int,
    group: dist.ProcessGroup,
    stager: Stager,
    options: SaveOptions = DEFAULT_SAVE_OPTIONS,
    writer_factory: WriterFactory | None = None,
) -> PendingSave:
    """Start :func:`save_checkpoint`'s save in the background (every rank calls it).

    The free space is checked and the small files are written and agreed on now; the state is staged into
    ``stager`` (its buffers are reused; on CUDA the copies run on a side stream: :meth:`PendingSave.wait_staged`
    before the next optimizer step) and DCP writes it from a thread whose collectives run on ``group`` (a gloo
    group of its own, never the training's: they would interleave with the steps').

    Raises:
        CheckpointSaveError: too little free space, or the small files could not be written on some rank.
    """
    started = time.perf_counter()
    check_room_for_save(ckpt_dir, step, app_state)
    tmp = _begin(ckpt_dir, step)
    error = None
    try:
        _write_small(tmp, extra, rank_state)
    except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = e
    _raise_if_any_failed(ckpt_dir, tmp, step, error)
    response = dcp.async_save(
        app_state,
        storage_writer=(writer_factory or options.writer)(tmp, step),
        process_group=group,
        async_stager=stager,
    )
    pending = PendingSave(ckpt_dir, tmp, step, keep_last, response, stager, started)
    pending.bytes = state_bytes(app_state)
    return pending
