"""Which tokens of each row this rank holds under sequence parallelism: one definition, read by the decoder (the
row's mask, positions and loss) and by the mixers that carry state along a row (:class:`RowSegments`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SequenceLayout"]


@dataclass(frozen=True)
class SequenceLayout:
    """Which tokens of each row this rank holds: ``[rank·s, (rank+1)·s)`` of rows of ``s·size`` tokens
    (:func:`apply_sequence_parallel` sets it on the decoder; size 1: whole rows).

    Raises:
        ValueError: ``size`` below 1 or ``rank`` outside ``[0, size)``.
    """

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"a sequence layout needs size >= 1 and 0 <= rank < size, got size={self.size}, rank={self.rank}"
            )

    def local(self, whole_BS: torch.Tensor, s: int) -> torch.Tensor:
        """This rank's ``s`` columns of a whole row's ``[B, s·size]`` tensor."""
        return whole_BS[:, self.rank * s : (self.rank + 1) * s]
