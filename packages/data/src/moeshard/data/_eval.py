"""Evaluation batches: one pass over a dataset in global batches split over ranks like training, every rank running
the same number of forwards.

Global batch ``i`` holds global rows ``[i*B, (i+1)*B)`` of the dataset (open an evaluation set without
``shuffle``: the rows in order) and rank ``r`` of ``W`` takes its contiguous share ``[r*B/W, (r+1)*B/W)`` of it in
micro-batches, as :class:`~moeshard.data.StepBatches` does for a training step. A pass covers the dataset's
``num_rows`` rows (a single source: each row once), or its first ``max_batches`` global batches.

The last global batch is filled up with *filler rows*: row 0 of the dataset with every label ``-100``. So every rank
gets the same number of micro-batches of the same shape, whatever the number of rows: under expert parallelism the
token all-to-alls (and FSDP's all-gathers) are collective, and a rank that ran one forward fewer would leave the
others waiting. Filler rows predict nothing: a loss summed over targets, divided by the targets, is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from moeshard.data._dataset import Dataset, check_batch_sizes
from moeshard.data._errors import DataError
from moeshard.data._packing import IGNORE_INDEX, Batch, Row, collate


class EvalBatches:
    """The micro-batches of one evaluation pass, per (global batch, rank): a pure function of both.

    Args:
        dataset: the evaluation rows (e.g. ``open_dataset(DataConfig(path=..., shuffle=False), ...)``).
        global_batch: rows per global batch, all ranks (e.g. the training global batch size).
        world_size: ranks; each takes ``global_batch / world_size`` rows per global batch.
        micro_batch: rows per forward.
        max_batches: evaluate the first ``max_batches`` global batches only (0: the whole dataset).

    Raises:
        DataError: the batch sizes do not split evenly (as for training), or ``max_batches < 0``.
    """

    def __init__(self, dataset: Dataset, *, global_batch: int, world_size: int, micro_batch: int, max_batches: int = 0):
        self.accum = check_batch_sizes(global_batch, world_size, micro_batch)
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 0:
            raise DataError(f"max_batches must be an integer >= 0 (0: the whole dataset), got {max_batches!r}")
        self.dataset, self.global_batch_size, self.world_size, self.micro_batch = (
            dataset,
            global_batch,
            world_size,
            micro_batch,
        )
        whole = -(-dataset.num_rows // global_batch)  # ceil: the last global batch may be partial
        self.num_batches = whole if max_batches == 0 else min(whole, max_batches)
        self.num_rows = min(dataset.num_rows, self.num_batches * global_batch)
        self._filler = None

    def filler(self) -> Row:
        """The row that fills the last global batch: row 0 with no target."""
        if self._filler is None:
            rows, _ = self.dataset.rows(np.array([0]))
            self._filler = dataclasses.replace(rows[0], labels=np.full_like(rows[0].labels, IGNORE_INDEX))
        return self._filler

    def micro_batches(self, index: int, rank: int) -> list[Batch]:
        """Rank ``rank``'s micro-batches of global batch ``index`` (0-based), in order; rows past the pass are
        filler rows (``sample_ids`` -1)."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"global batch {index} of an evaluation pass of {self.num_batches}")
        per_rank = self.global_batch_size // self.world_size
        g = index * self.global_batch_size + rank * per_rank + np.arange(per_rank)
        real = g < self.num_rows
        rows, src = self.dataset.rows(g[real]) if real.any() else ([], np.zeros(0, dtype=np.int64))
        rows = list(rows) + [self.filler()] * int((~real).sum())
        sample_ids = np.where(real, g, -1)
        source_ids = np.concatenate([src, np.zeros(int((~real).sum()), dtype=np.int64)])
        mb = self.micro_batch
        return [
            collate(rows[i : i + mb], sample_ids[i : i + mb], source_ids[i : i + mb]) for i in range(0, per_rank, mb)
        ]

    def rank_batches(self, rank: int) -> Iterator[Batch]:
        """Every micro-batch of rank ``rank`` in the pass, in order: ``num_batches * accum`` of them on every rank."""
        for index in range(self.num_batches):
            yield from self.micro_batches(index, rank)
