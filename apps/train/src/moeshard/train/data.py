"""Training data: JSONL / Parquet records with "text" or "input_ids", or generated sequences.

Samples: with ``packing: true`` all documents are concatenated (an EOS token after each, when the model has one)
and cut into ``seq_len`` pieces; with ``packing: false`` each non-empty record is one sample, truncated to
``seq_len`` or right-padded (padding masked out of attention and loss).

Sample order is a pure function of (step, config): with ``shuffle: false`` step ``s`` trains on samples
``s*B .. s*B+B-1`` of the global batch ``B`` in file order (wrapping into the next epoch), each rank taking its
contiguous share ``[r*B/W, (r+1)*B/W)``; with ``shuffle: true`` each epoch is a seeded permutation. Resuming at a
step therefore needs no iterator state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moeshard.train.config import DataConfig

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``input_ids``/``labels`` ``[B, S]`` (labels -100 where ignored), optional mask."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None
    sample_ids: tuple[int, ...]


class TokenDataset:
    """Samples of exactly ``seq_len`` tokens (``input_ids``, ``labels``, ``attention_mask`` or None)."""

    def __init__(self, ids: list[torch.Tensor], labels: list[torch.Tensor], masks: list[torch.Tensor] | None):
        self.ids, self.labels, self.masks = ids, labels, masks

    def __len__(self) -> int:
        return len(self.ids)

    def collate(self, indices: list[int]) -> Batch:
        """Stack the samples at ``indices`` into a batch."""
        mask = torch.stack([self.masks[i] for i in indices]) if self.masks is not None else None
        return Batch(
            torch.stack([self.ids[i] for i in indices]),
            torch.stack([self.labels[i] for i in indices]),
            mask,
            tuple(indices),
        )


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"data.path {path} does not exist; point data.path at a .jsonl or .parquet file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object with 'text' or 'input_ids'")
            records.append(rec)
    return records


def _tokenize(records: list[dict], cfg: DataConfig, path: Path) -> list[list[int]]:
    tokenizer = None
    docs = []
    for i, rec in enumerate(records):
        if "input_ids" in rec:
            ids = rec["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{path}: record {i}: input_ids must be a list of integers")
        elif "text" in rec:
            if tokenizer is None:
                if cfg.tokenizer is None:
                    raise ValueError(
                        f"{path}: record {i} has 'text' but data.tokenizer is not set; "
                        "set data.tokenizer to a local tokenizer directory or pre-tokenise into 'input_ids'"
                    )
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)
            ids = tokenizer(rec["text"], add_special_tokens=False)["input_ids"]
        else:
            raise ValueError(f"{path}: record {i} has neither 'text' nor 'input_ids' (keys: {sorted(rec)})")
        docs.append(ids)
    return docs


def _synthetic_docs(cfg: DataConfig, vocab_size: int) -> list[list[int]]:
    # Arithmetic sequences mod a small alphabet: learnable from context, so the loss visibly falls.
    g = torch.Generator().manual_seed(cfg.seed)
    alphabet = min(vocab_size, 97)
    starts = torch.randint(0, alphabet, (cfg.synthetic_samples,), generator=g)
    strides = torch.randint(1, 4, (cfg.synthetic_samples,), generator=g)
    j = torch.arange(cfg.seq_len)
    seqs = (starts[:, None] + strides[:, None] * j[None, :]) % alphabet
    return seqs.tolist()


def build_dataset(cfg: DataConfig, *, vocab_size: int, eos_id: int | None, pad_id: int | None) -> TokenDataset:
    """Read, tokenise, validate and cut the data into ``seq_len`` samples.

    Raises:
        ValueError: a token id outside the vocabulary, no usable sample, a malformed record.
    """
    if cfg.synthetic:
        docs, source = _synthetic_docs(cfg, vocab_size), "synthetic data"
    else:
        path = Path(cfg.path)
        docs, source = _tokenize(_read_records(path), cfg, path), str(path)
    for i, doc in enumerate(docs):
        bad = [t for t in doc if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(
                f"{source}: record {i} holds token id {bad[0]} outside the vocabulary [0, {vocab_size}); "
                "the data was tokenised for another model, or model.overrides.vocab_size is too small"
            )
    S = cfg.seq_len
    ids, labels, masks = [], [], []
    if cfg.packing or cfg.synthetic:
        stream: list[int] = []
        for doc in docs:
            stream.extend(doc)
            if eos_id is not None and not cfg.synthetic:
                stream.append(eos_id)
        flat = torch.tensor(stream, dtype=torch.long)
        for k in range(len(flat) // S):
            chunk = flat[k * S : (k + 1) * S]
            ids.append(chunk)
            labels.append(chunk)
        masks_out = None
    else:
        pad = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        for doc in docs:
            if not doc:
                continue  # a fully masked row would make attention NaN; nothing to learn from it anyway
            doc = doc[:S]
            n = len(doc)
            x = torch.full((S,), pad, dtype=torch.long)
            x[:n] = torch.tensor(doc)
            y = torch.full((S,), IGNORE_INDEX, dtype=torch.long)
            y[:n] = x[:n]
            m = torch.zeros(S, dtype=torch.long)
            m[:n] = 1
            ids.append(x)
            labels.append(y)
            masks.append(m)
        masks_out = masks
    if not ids:
        raise ValueError(
            f"{source}: no training sample of seq_len {S} could be made (empty dataset, or packing with fewer "
            "tokens than one sequence); add data or lower data.seq_len"
        )
    return TokenDataset(ids, labels, masks_out)


def check_batch_sizes(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Gradient accumulation steps of ``global_batch`` over ``world_size`` ranks in micro-batches of ``micro_batch``.

    Raises:
        ValueError: the global batch does not split evenly into ranks and micro-batches.
    """
    if global_batch % world_size:
        raise ValueError(
            f"train.global_batch_size {global_batch} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    if per_rank % micro_batch:
        raise ValueError(
            f"per-rank batch {per_rank} (global {global_batch} / world {world_size}) is not divisible by "
            f"train.micro_batch_size {micro_batch}; pick a micro batch that divides {per_rank}"
        )
    return per_rank // micro_batch


class GlobalBatches:
    """Deterministic assignment of samples to (step, rank, micro-batch)."""

    def __init__(
        self, num_samples: int, global_batch: int, world_size: int, micro_batch: int, shuffle: bool, seed: int
    ):
        check_batch_sizes(global_batch, world_size, micro_batch)
        if num_samples < global_batch:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch}; "
                "add data or lower train.global_batch_size"
            )
        per_rank = global_batch // world_size
        self.n, self.B, self.W, self.mb, self.shuffle, self.seed = (
            num_samples,
            global_batch,
            world_size,
            micro_batch,
            shuffle,
            seed,
        )
        self.accum = per_rank // micro_batch
        self._perm_cache: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        if epoch not in self._perm_cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm_cache = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perm_cache[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Sample indices of the whole global batch of ``step`` (0-based), in rank order."""
        out = []
        for j in range(self.B):
            p = step * self.B + j
            out.append(self._order(p // self.n)[p % self.n])
        return out

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """This rank's micro-batches of ``step``: its contiguous share, in order."""
        per_rank = self.B // self.W
        mine = self.global_indices(step)[rank * per_rank : (rank + 1) * per_rank]
        return [mine[i : i + self.mb] for i in range(0, per_rank, self.mb)]
