"""``checkpoint.async``: a checkpoint written in the background, published like a synchronous one.

The same temporary folder, ``COMPLETE`` record and rename as :func:`moeshard.train.checkpoint.save_checkpoint`:
:func:`start_async_save` writes the small files and agrees on them at once, stages the state to host memory and lets
DCP's ``async_save`` write it from a thread; :class:`PendingSave` publishes it only once the write ended well on
every rank, and reports a failed one (:class:`~moeshard.train.errors.CheckpointSaveError`) without publishing it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.api import CheckpointException

from moeshard.train.checkpoint import _begin, _publish, _raise_if_any_failed, _write_small, checkpoint_name


def make_stager(device: torch.device):
    """DCP's stager for one ``checkpoint.async`` save: on CUDA a copy into pinned host memory on a side stream, in
    the background; elsewhere a plain copy in the caller. :class:`PendingSave` closes it when the save ends."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda
        )
    )


class PendingSave:
    """A checkpoint being written in the background (``checkpoint.async``): the same temporary folder, ``COMPLETE``
    and rename as :func:`save_checkpoint`, published by rank 0 only once the write finished on every rank.

    DCP's save ends with a gather of every rank's write result at rank 0 and a broadcast of the outcome, so a
    successful end on rank 0 means every rank's shard is written: :meth:`publish_if_done` (rank 0, at any step
    end) publishes it without a collective; :meth:`wait` (every rank, at the same step: the next save, the end of
    the run) agrees on the outcome and raises :class:`CheckpointSaveError` for a failed write, never published.
    """

    def __init__(self, ckpt_dir: Path, tmp: Path, step: int, keep_last: int, response: Any, stager: Any) -> None:
        self.ckpt_dir, self.tmp, self.step, self.keep_last, self.stager = ckpt_dir, tmp, step, keep_last, stager
        # DCP returns a Future, or with background staging an AsyncSaveResponse of two.
        self.upload = getattr(response, "upload_completion", response)
        self.staging = getattr(response, "staging_completion", None)
        self.published: Path | None = None

    def close_stager(self) -> None:
        """Release the save's staging resources (its thread, pinned buffers) once its write has ended."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def wait_staged(self) -> None:
        """Block until the state is copied to the host: call it before anything changes the state (the optimizer
        step). A staging error is left for :meth:`wait`."""
        if self.staging is not None:
            concurrent.futures.wait([self.staging])

    def publish_if_done(self) -> Path | None:
        """Rank 0: publish the checkpoint when its write has ended well on every rank; its folder once published."""
        if self.published is None and self.upload.done() and self.upload.exception() is None:
            self.published = _publish(self.ckpt_dir, self.tmp, self.step, self.keep_last)
        return self.published

    def wait(self) -> Path:
        """Every rank: wait for the write, agree on its outcome, publish (rank 0). Returns the final folder.

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
        finally:
            self.close_stager()
        _raise_if_any_failed(self.ckpt_dir, self.tmp, self.step, error, how=" (in the background)")
        if dist.get_rank() == 0:
            self.publish_if_done()
        dist.barrier()
        return self.ckpt_dir / checkpoint_name(self.step)


def start_async_save(
    ckpt_dir: Path,
    step: int,
    app_state: dict[str, Any],
    extra: dict[str, Any],
    rank_state: dict[str, Any],
    *,
    keep_last: int,
    group: dist.ProcessGroup,
    stager: Any,
    writer_factory: Callable[[Path, int], StorageWriter] | None = None,
) -> PendingSave:
    """Start :func:`save_checkpoint`'s save in the background: the small files are written and agreed on now, the
    state is staged to host memory (in the background on CUDA: :meth:`PendingSave.wait_staged`) and DCP writes
    it from a thread whose collectives run on ``group`` (a gloo group of its own, never the training's).
    ``writer_factory``: ``(folder, step) -> StorageWriter`` (None: a plain ``FileSystemWriter``).

    Raises:
        CheckpointSaveError: the small files could not be written on some rank.
    """
    tmp = _begin(ckpt_dir, step)
    error = None
    try:
        _write_small(tmp, extra, rank_state)
    except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = e
    _raise_if_any_failed(ckpt_dir, tmp, step, error)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the optimizer step that made this state may still run; staging reads it
    writer = writer_factory(tmp, step) if writer_factory is not None else dcp.FileSystemWriter(str(tmp))
    response = dcp.async_save(app_state, storage_writer=writer, process_group=group, async_stager=stager)
    return PendingSave(ckpt_dir, tmp, step, keep_last, response, stager)
