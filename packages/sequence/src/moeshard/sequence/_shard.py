"""One rank's view of a packed row under sequence parallelism, and the checks an sp size must pass.

Legend: B rows, S tokens per row (the whole row), s = S / sp tokens of one shard, H query heads, G key/value heads.

A row's ``S`` tokens are split into ``sp`` contiguous shards; sequence rank ``r`` holds tokens ``[r·s, (r+1)·s)``.
What belongs to the whole row is decided before the split: positions (they restart in every document), document
ids (attention, after the all-to-all, sees every token of the row and masks by them), and the targets. The model's
usual loss shifts the labels inside (position ``t`` predicts ``labels[t + 1]``); a shard cannot, since the target
of its last token is the first label of the next shard. So the labels are shifted here, over the whole row, and the
shard holds ``targets[t] = labels[t + 1]`` (``-100`` for the row's last token): every pair ``(t, t + 1)``, the one
across a shard edge too, is counted once, on the rank that holds ``t``, and the union of the shards' targets is
exactly the whole-row model's. ``moeshard.data`` never makes a target cross a document (a piece's first token is
no target), so none crosses a shard either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""The target value the loss ignores (transformers' ``ignore_index``)."""


def check_sequence_parallel(
    sp_size: int,
    *,
    seq_len: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> None:
    """Raise a one-line ``ValueError`` naming the fix where ``sp_size`` cannot shard these rows or heads.

    Args:
        sp_size: ranks sharing one row (1: no sequence parallelism).
        seq_len: tokens per row; each shard holds ``seq_len / sp_size`` of them.
        num_heads: query heads; each rank attends with ``num_heads / sp_size`` of them.
        num_kv_heads: key/value heads (GQA); they must divide ``num_heads``. Fewer than ``sp_size`` is fine: they
            are replicated (see :func:`kv_replication`).
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size={sp_size!r} must be a positive integer (1 turns sequence parallelism off)")
    if seq_len is not None and seq_len % sp_size:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by sp_size={sp_size}: each rank holds seq_len/sp_size contiguous "
            f"tokens; set seq_len to a multiple of {sp_size} (e.g. {(seq_len // sp_size + 1) * sp_size})"
        )
    if num_heads is not None and num_heads % sp_size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(
            f"num_attention_heads={num_heads} is not divisible by sp_size={sp_size}: each rank attends with "
            f"num_heads/sp_size heads; choose sp_size among {divisors}"
        )
    if num_heads is not None and num_kv_heads is not None and (num_kv_heads < 1 or num_heads % num_kv_heads):
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} does not divide num_attention_heads={num_heads}: grouped-query "
            "attention needs a whole number of query heads per key/value head; fix the model's config"
        )


@dataclass(frozen=True)
class SequenceShard:
    """Sequence rank ``sp_rank``'s part of a batch of whole rows (see :func:`shard_row`).

    Attributes:
        input_ids: ``[B, s]`` this shard's tokens.
        targets: ``[B, s]`` already shifted: ``targets[:, t]`` is the whole row's ``labels[:, start + t + 1]``
            (``-100``: no target). Give them to a loss that does not shift again.
        position_ids: ``[B, s]`` this shard's slice of the whole row's positions (RoPE runs per token, before the
            all-to-all).
        row_document_ids: ``[B, S]`` the whole row's document ids, for the attention mask built after the
            all-to-all (which sees the whole row); None for rows of one document.
        row_attention_mask: ``[B, S]`` the whole row's padding mask (1 token, 0 padding), or None.
        sp_rank: this rank's index in its sequence group.
        sp_size: ranks sharing the row.
        start: the shard's first token in the row; it holds ``[start, start + s)``.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    row_document_ids: torch.Tensor | None
    row_attention_mask: torch.Tensor | None
    sp_rank: int
    sp_size: int
    start: int

    @property
    def stop(self) -> int:
        """One past the shard's last token in the row."""
        return self.start + self.input_ids.shape[-1]

    @property
    def seq_len(self) -> int:
        """Tokens of the whole row, ``S``."""
        return self.input_ids.shape[-1] * self.sp_size

    @property
    def document_ids(self) -> torch.Tensor | None:
        """``[B, s]`` this shard's slice of the document ids (None for rows of one document)."""
        return None if self.row_document_ids is None else self.row_document_ids[:, self.start : self.stop]

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """``[B, s]`` this shard's slice of the padding mask (per-token statistics: the aux loss), or None."""
        return None if self.row_attention_mask is None else self.row_attention_mask[:, self.start : self.stop]

    @property
    def num_targets(self) -> int:
        """Targets of this shard; summed over the sequence group they are the whole rows'."""
        return int((self.targets != IGNORE_INDEX).sum())


def shift_labels(labels_BS: torch.Tensor) -> torch.Tensor:
    """``targets[:, t] = labels[:, t + 1]``, ``-100`` for the last token: the shift every causal-LM loss makes
    (transformers' convention: labels unshifted), made over the whole row before it is split."""
    return F.pad(labels_BS, (0, 1), value=IGNORE_INDEX)[..., 1:]


def shard_row(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    sp_rank: int,
    sp_size: int,
    position_ids: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> SequenceShard:
    """Sequence rank ``sp_rank``'s contiguous shard of whole rows ``[B, S]`` (``moeshard.data.Batch``'s tensors).

    Args:
        input_ids: ``[B, S]`` the whole rows' tokens.
        labels: ``[B, S]`` unshifted (transformers' convention; ``-100`` ignored); shifted here, before the split.
        sp_rank: this rank's index in its sequence group, ``0 <= sp_rank < sp_size``.
        sp_size: ranks sharing each row; must divide ``S``.
        position_ids: ``[B, S]`` or ``[S]`` whole-row positions (packed rows restart them per document); default
            ``0..S-1``.
        document_ids: ``[B, S]`` whole-row document ids (kept whole, for the attention mask), or None.
        attention_mask: ``[B, S]`` whole-row padding mask (kept whole), or None.

    Returns:
        The rank's :class:`SequenceShard`.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    check_sequence_parallel(sp_size, seq_len=S)
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} must be in [0, sp_size={sp_size})")
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must have input_ids' shape {(B, S)}, got {tuple(labels.shape)}")
    for name, t in (("document_ids", document_ids), ("attention_mask", attention_mask)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' shape {(B, S)} (the whole rows), got {tuple(t.shape)}")
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device)
    if position_ids.dim() == 1:
        position_ids = position_ids.expand(B, S)
    if position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids must be [seq_len] or [batch, seq_len] of the whole rows, got {tuple(position_ids.shape)}"
        )
    s = S // sp_size
    start = sp_rank * s
    window = slice(start, start + s)
    return SequenceShard(
        input_ids=input_ids[:, window],
        targets=shift_labels(labels)[:, window],
        position_ids=position_ids[:, window],
        row_document_ids=document_ids,
        row_attention_mask=attention_mask,
        sp_rank=sp_rank,
        sp_size=sp_size,
        start=start,
    )
