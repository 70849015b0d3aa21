"""Rows and batches: document-masked packing, padded rows, and the micro-batch the model consumes.

Legend: B rows, S tokens per row (``seq_len``), N segments in a batch.

Packing (``packing: true``): a row is a window of S tokens of a source's token stream (every document followed by
its EOS). Documents are *pieces* of the row: a document that crosses a row boundary, or is longer than S, is cut,
and every piece is a document of its own: positions restart at 0 and it attends to nothing of its other pieces
(rows never attend to each other). Per row:

- ``input_ids[t]``: the token;
- ``labels[t]``: the token when it is a target, else -100, in the transformers convention (unshifted: the model
  predicts ``labels[t + 1]`` from position ``t``). A piece's first token is never a target (nothing before it in
  its document predicts it: so a document's final EOS predicts nothing, and neither does the last token of a row);
  masked tokens (SFT) and padding are not targets either;
- ``position_ids[t]``: ``t`` minus the start of its piece;
- ``document_ids[t]``: the piece's index in the row (0, 1, ...), -1 on padding.

Padded (``packing: false``): a row is one document (or one S-token piece of a longer one), right-padded with
``pad_id``; ``attention_mask`` is 1 on tokens and 0 on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label of a token that is not a target (transformers' ``ignore_index``)."""


@dataclass(frozen=True)
class Row:
    """One row of ``S`` tokens (numpy, int64; ``document_ids`` int32; ``attention_mask`` None when unpadded)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    document_ids: np.ndarray
    attention_mask: np.ndarray | None = None


def pack_window(tokens: np.ndarray, mask: np.ndarray | None, starts: np.ndarray) -> Row:
    """The packed row of a window: ``tokens`` [S], its loss ``mask`` (bool or None), the piece ``starts``."""
    S = tokens.size
    is_start = np.zeros(S, dtype=bool)
    is_start[starts] = True
    doc = np.cumsum(is_start, dtype=np.int64) - 1
    positions = np.arange(S, dtype=np.int64) - starts[doc]
    no_target = is_start if mask is None else is_start | ~mask
    labels = np.where(no_target, IGNORE_INDEX, tokens)
    return Row(tokens, labels, positions, doc.astype(np.int32))


def pad_piece(tokens: np.ndarray, mask: np.ndarray | None, seq_len: int, pad_id: int) -> Row:
    """The padded row of one document piece (``tokens`` of at most ``seq_len``)."""
    n = tokens.size
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    ids[:n] = tokens
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    keep = np.ones(n, dtype=bool) if mask is None else mask.copy()
    keep[0] = False
    labels[:n] = np.where(keep, tokens, IGNORE_INDEX)
    doc = np.full(seq_len, -1, dtype=np.int32)
    doc[:n] = 0
    attn = np.zeros(seq_len, dtype=np.int64)
    attn[:n] = 1
    return Row(ids, labels, np.arange(seq_len, dtype=np.int64), doc, attn)


@dataclass(frozen=True)
class Batch:
    """A micro-batch: what one forward/backward consumes.

    ``input_ids``, ``labels``, ``position_ids`` ``[B, S]`` int64; ``document_ids`` ``[B, S]`` int32 (piece index
    within its row, -1 on padding): a token attends to token ``j <= t`` of its row iff their document ids are equal,
    which is the block-diagonal causal mask (flex_attention ``BlockMask``, or see ``document_causal_mask``);
    ``cu_seqlens`` ``[N + 1]`` int32 and ``max_seqlen``: the same segments over the flattened ``B*S`` tokens for
    varlen attention (each row's padding is a segment of its own); ``attention_mask`` ``[B, S]`` (1 token, 0 padding)
    or None when nothing is padded; ``sample_ids``: global row indices; ``source_ids``: each row's source index.

    The model call: ``model(b.input_ids, labels=b.labels, position_ids=b.position_ids,
    document_ids=b.document_ids, attention_mask=b.attention_mask)``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    attention_mask: torch.Tensor | None
    sample_ids: tuple[int, ...]
    source_ids: tuple[int, ...]

    @property
    def num_targets(self) -> int:
        """Tokens this batch predicts (labels other than -100)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with every tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """The batch in pinned host memory (for asynchronous copies to the GPU)."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> Batch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = fn(v) if isinstance(v, torch.Tensor) else v
        return Batch(**kw)


def collate(rows: Sequence[Row], sample_ids: Sequence[int], source_ids: Sequence[int]) -> Batch:
    """Stack rows into a ``Batch`` (computes ``cu_seqlens``/``max_seqlen`` from the document ids)."""
    doc = np.stack([r.document_ids for r in rows])
    B, S = doc.shape
    change = np.ones((B, S), dtype=bool)
    change[:, 1:] = doc[:, 1:] != doc[:, :-1]
    seg_starts = np.flatnonzero(change.reshape(-1))
    cu = np.append(seg_starts, B * S).astype(np.int32)
    attn = None
    if any(r.attention_mask is not None for r in rows):
        attn = torch.from_numpy(
            np.stack([r.attention_mask if r.attention_mask is not None else np.ones(S, np.int64) for r in rows])
        )
    return Batch(
        input_ids=torch.from_numpy(np.stack([r.input_ids for r in rows])),
        labels=torch.from_numpy(np.stack([r.labels for r in rows])),
        position_ids=torch.from_numpy(np.stack([r.position_ids for r in rows])),
        document_ids=torch.from_numpy(doc),
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=int(np.diff(cu).max()),
        attention_mask=attn,
        sample_ids=tuple(int(i) for i in sample_ids),
        source_ids=tuple(int(i) for i in source_ids),
    )


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The dense boolean ``[B, 1, S, S]`` mask (True: attend) of ``document_ids`` ``[B, S]``: same document and
    not in the future. For CPU reference paths and tests; on GPU build a flex_attention ``BlockMask`` instead."""
    S = document_ids.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]
