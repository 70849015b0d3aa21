"""Sources, mixtures and the rows of each step: a pure function of (config, step, row), never of iterator state.

Terms: a *global row* ``g = step * B + j`` is row ``j`` of step ``step``'s global batch of ``B`` rows; rank ``r`` of
``W`` trains on rows ``[r*B/W, (r+1)*B/W)`` of it, in micro-batches, so the global batch of a step does not depend on
the world size and a resume (also at another world size or layout) continues exactly.

Mixture: with source weights ``w_k``, the first ``T`` global rows hold ``A_k(T)`` rows of source ``k``, where
``A_0(T) = floor(T q_0 + 1/2)`` with ``q_0 = w_0 / sum(w)``, then the same over the remaining rows and sources
(``q_k = w_k / sum_{j >= k} w_j``; the last source takes the rest). Each ``A_k`` grows by 0 or 1 per row, so global
row ``g`` belongs to the one source whose count grows at ``g``, and it is that source's row number ``A_k(g)``:
proportions are exact to within one row at every step, and the interleaving is even (no bursts).
Within a source, row number ``q`` is row ``q mod n`` of epoch ``q div n``, through a seeded permutation of the
``n`` rows per epoch when shuffling (a Feistel network: O(1) memory for any corpus size).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from moeshard.data._config import DataConfig, SourceConfig
from moeshard.data._errors import DataError
from moeshard.data._format import TokenStore
from moeshard.data._inputs import iter_batches, plan_units, resolve, source_schema
from moeshard.data._packing import Batch, Row, collate, pack_window, pad_piece
from moeshard.data._tokenize import EncodeOptions, Encoder, load_tokenizer

_DEN = 1 << 20  # mixture shares are quantised to 1/_DEN: exact integer arithmetic, same on every machine
_M64 = (1 << 64) - 1


def _mix_int(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(x: np.ndarray, n: int, key: int) -> np.ndarray:
    """A seeded bijection of ``[0, n)`` applied to ``x`` (4-round Feistel network with cycle walking)."""
    x = np.asarray(x, dtype=np.int64)
    if n <= 1:
        return x
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    m = np.uint64((1 << (bits // 2)) - 1)
    round_keys = [np.uint64(_mix_int(key * 4 + r)) for r in range(4)]

    def rounds(y: np.ndarray) -> np.ndarray:
        left, right = y >> half, y & m
        for k in round_keys:
            left, right = right, left ^ (_mix(right ^ k) & m)
        return (left << half) | right

    y = rounds(x.astype(np.uint64))
    out_of_range = y >= np.uint64(n)
    while out_of_range.any():  # cycle walking: a bijection of [0, 2^bits) restricted to [0, n)
        y[out_of_range] = rounds(y[out_of_range])
        out_of_range = y >= np.uint64(n)
    return y.astype(np.int64)


class RowSource:
    """The rows of one token store: packed windows of ``seq_len`` tokens, or padded document pieces.

    Packing: row ``i`` is tokens ``[i*S, (i+1)*S)``; the tail of fewer than S tokens is never used; start-up reads
    nothing. Padded: one row per ``seq_len`` piece of each document, but for a last piece of a single token (it
    would predict nothing); start-up reads the document index (O(documents)).
    """

    def __init__(self, store: TokenStore, seq_len: int, packing: bool, pad_id: int):
        self.store, self.seq_len, self.packing, self.pad_id = store, seq_len, packing, pad_id
        self.name = store.name
        if packing:
            self.num_rows = store.num_tokens // seq_len
        else:
            lengths = store.document_lengths()
            self._doc_end = np.cumsum(lengths)
            # A piece's first token is no target, so a piece of one token predicts nothing: a document's last piece
            # of one token (a record of k·S tokens plus its EOS, or an empty record's lone EOS) forms no row, and
            # that EOS goes untrained. ceil((L - 1) / S) pieces of a document of L tokens.
            self._pieces_end = np.cumsum(-(-np.maximum(lengths - 1, 0) // seq_len))
            self.num_rows = int(self._pieces_end[-1]) if lengths.size else 0

    def _piece(self, i: int) -> tuple[int, int]:
        d = int(np.searchsorted(self._pieces_end, i, side="right"))
        first_row = int(self._pieces_end[d - 1]) if d else 0
        doc_start = int(self._doc_end[d - 1]) if d else 0
        start = doc_start + (i - first_row) * self.seq_len
        return start, min(start + self.seq_len, int(self._doc_end[d]))

    def row(self, i: int) -> Row:
        """Row ``i`` (``0 <= i < num_rows``)."""
        if self.packing:
            S = self.seq_len
            return pack_window(*self.store.window(i * S, (i + 1) * S))
        tokens, mask, _ = self.store.window(*self._piece(i))
        return pad_piece(tokens, mask, self.seq_len, self.pad_id)

    def tokens_in_rows(self, rows: np.ndarray) -> int:
        """Tokens (padding excluded) in the given rows."""
        if self.packing:
            return int(rows.size) * self.seq_len
        return sum(b - a for a, b in (self._piece(int(i)) for i in rows))


class Dataset:
    """Weighted sources and the map from a global row to (source, row), a pure function of the config.

    Global row ``g`` of a mixture goes to the source whose running share grows at ``g`` (shares exact to within one
    row at every prefix, evenly interleaved); within a source, rows are taken in order, or through a seeded
    permutation per epoch with ``shuffle``; a source that runs out starts its next epoch.
    """

    def __init__(self, sources: Sequence[RowSource], weights: Sequence[float], *, shuffle: bool, seed: int):
        if not sources or len(sources) != len(weights):
            raise DataError("a dataset needs one or more sources, each with a weight")
        self.sources, self.shuffle, self.seed = list(sources), shuffle, seed
        self.weights = [w / sum(weights) for w in weights]
        self.seq_len = sources[0].seq_len
        self._num = []  # quantised q_k of all but the last source
        for k in range(len(weights) - 1):
            # clamped so that neither this source nor the ones after it can starve
            self._num.append(min(max(round(weights[k] / sum(weights[k:]) * _DEN), 1), _DEN - 1))

    @property
    def names(self) -> list[str]:
        """The sources' names, in config order."""
        return [s.name for s in self.sources]

    @property
    def num_rows(self) -> int:
        """Rows of all sources together (one evaluation pass: ``moeshard.data.EvalBatches``)."""
        return sum(s.num_rows for s in self.sources)

    @property
    def fingerprint(self) -> str:
        """A content fingerprint of every source (store it with a checkpoint to check a resume's data)."""
        return "+".join(s.store.fingerprint for s in self.sources)

    def _counts(self, T: np.ndarray) -> np.ndarray:
        rest = np.asarray(T, dtype=np.int64).copy()
        out = np.empty((len(self.sources), rest.size), dtype=np.int64)
        for k, num in enumerate(self._num):
            out[k] = (rest * num + _DEN // 2) // _DEN
            rest -= out[k]
        out[-1] = rest
        return out

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source index, row index within the source)`` of global rows ``g``."""
        g = np.asarray(g, dtype=np.int64)
        before, after = self._counts(g), self._counts(g + 1)
        src = np.argmax(after - before, axis=0)
        q = before[src, np.arange(g.size)]
        idx = np.empty_like(q)
        for k, s in enumerate(self.sources):
            sel = src == k
            if not sel.any():
                continue
            epoch, r = np.divmod(q[sel], s.num_rows)
            if self.shuffle:
                for e in np.unique(epoch):
                    at = epoch == e
                    r[at] = permute(r[at], s.num_rows, _mix_int(_mix_int(self.seed) ^ (k << 40) ^ int(e)))
            idx[sel] = r
        return src, idx

    def rows(self, g: Sequence[int] | np.ndarray) -> tuple[list[Row], np.ndarray]:
        """The rows of global rows ``g`` and their source indices."""
        src, idx = self.locate(np.asarray(g))
        return [self.sources[k].row(int(i)) for k, i in zip(src, idx)], src

    def rows_per_source(self, start: int, stop: int) -> np.ndarray:
        """How many of global rows ``[start, stop)`` each source holds (O(sources))."""
        c = self._counts(np.array([start, stop]))
        return c[:, 1] - c[:, 0]

    def tokens_per_source(self, start: int, stop: int) -> dict[str, int]:
        """Tokens (padding excluded) each source contributes to global rows ``[start, stop)``."""
        if all(s.packing for s in self.sources):
            return {s.name: int(n) * s.seq_len for s, n in zip(self.sources, self.rows_per_source(start, stop))}
        src, idx = self.locate(np.arange(start, stop))
        return {s.name: s.tokens_in_rows(idx[src == k]) for k, s in enumerate(self.sources)}

    def summary(self) -> dict[str, dict[str, int | float | str]]:
        """Per source name: its ``weight`` (normalised), ``tokens``, ``documents``, ``rows`` and content
        ``fingerprint``; JSON-safe, to store with a run and say what changed when a resume finds other data."""
        return {
            s.name: {
                "weight": w,
                "tokens": s.store.num_tokens,
                "documents": s.store.num_documents,
                "rows": s.num_rows,
                "fingerprint": s.store.fingerprint,
            }
            for s, w in zip(self.sources, self.weights)
        }

    def describe(self) -> str:
        """One line per source: name, weight, tokens, rows."""
        return "\n".join(
            f"{s.name}: weight {w:.3f}, {s.store.num_tokens:,} tokens, {s.num_rows:,} rows of {s.seq_len}"
            for s, w in zip(self.sources, self.weights)
        )


def check_batch_sizes(global_batch: int, world_size: int, micro_batch: int) -> int:
    """Gradient accumulation steps of ``global_batch`` rows over ``world_size`` ranks in ``micro_batch`` rows.

    Raises:
        DataError: the global batch does not split evenly into ranks and micro-batches.
    """
    if min(global_batch, world_size, micro_batch) < 1:
        raise DataError(f"batch sizes and world size must be >= 1, got {global_batch}, {world_size}, {micro_batch}")
    if global_batch % world_size:
        raise DataError(
            f"train.global_batch_size {global_batch} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    if per_rank % micro_batch:
        raise DataError(
            f"per-rank batch {per_rank} (global {global_batch} / world {world_size}) is not divisible by "
            f"train.micro_batch_size {micro_batch}; pick a micro batch that divides {per_rank}"
        )
    return per_rank // micro_batch


class StepBatches:
    """The micro-batches of every (step, rank): rank ``r`` takes its contiguous share of the step's global batch."""

    def __init__(self, dataset: Dataset, *, global_batch: int, world_size: int, micro_batch: int):
        self.accum = check_batch_sizes(global_batch, world_size, micro_batch)
        self.dataset, self.global_batch_size, self.world_size, self.micro_batch = (
            dataset,
            global_batch,
            world_size,
            micro_batch,
        )

    def rank_rows(self, step: int, rank: int) -> np.ndarray:
        """Global row indices rank ``rank`` trains on at ``step``."""
        per_rank = self.global_batch_size // self.world_size
        return step * self.global_batch_size + rank * per_rank + np.arange(per_rank)

    def micro_batches(self, step: int, rank: int) -> list[Batch]:
        """This rank's micro-batches of ``step`` (0-based), in order."""
        g = self.rank_rows(step, rank)
        rows, src = self.dataset.rows(g)
        mb = self.micro_batch
        return [collate(rows[i : i + mb], g[i : i + mb], src[i : i + mb]) for i in range(0, len(rows), mb)]

    def global_batch(self, step: int) -> Batch:
        """The whole global batch of ``step`` (all ranks, in rank order) as one batch."""
        g = step * self.global_batch_size + np.arange(self.global_batch_size)
        rows, src = self.dataset.rows(g)
        return collate(rows, g, src)

    def tokens_per_source(self, start_step: int, stop_step: int) -> dict[str, int]:
        """Tokens each source contributes to steps ``[start_step, stop_step)``, all ranks (for logging)."""
        B = self.global_batch_size
        return self.dataset.tokens_per_source(start_step * B, stop_step * B)


# ---- building from the config -------------------------------------------------------------------------------------


def _synthetic_store(cfg: DataConfig, vocab_size: int) -> TokenStore:
    import torch

    # Arithmetic sequences mod a small alphabet: learnable from context, so the loss visibly falls.
    g = torch.Generator().manual_seed(cfg.seed)
    alphabet = min(vocab_size, 97)
    starts = torch.randint(0, alphabet, (cfg.synthetic_samples,), generator=g)
    strides = torch.randint(1, 4, (cfg.synthetic_samples,), generator=g)
    j = torch.arange(cfg.seq_len)
    seqs = ((starts[:, None] + strides[:, None] * j[None, :]) % alphabet).numpy()
    return TokenStore.from_documents([(s, None) for s in seqs], name="synthetic", eos_id=None, has_mask=False)


def _raw_store(src: SourceConfig, files, cfg: DataConfig, vocab_size: int, eos_id: int | None) -> TokenStore:
    schema = source_schema(files, f"source {src.name!r}")
    tok = None
    if schema.kind != "tokens" or cfg.tokenizer is not None:
        if cfg.tokenizer is None:
            raise DataError(
                f"source {src.name!r} holds '{schema.columns[0]}' records but data.tokenizer is not set; set it to "
                "a local tokenizer folder, or prepare the corpus (python -m moeshard.data prepare)"
            )
        tok = load_tokenizer(cfg.tokenizer)
        eos_id = tok.eos_token_id if tok.eos_token_id is not None else eos_id
    enc = Encoder(EncodeOptions(schema, cfg.tokenizer, eos_id, vocab_size), tokenizer=tok)
    docs = []
    for unit in plan_units(files, 1 << 62):
        for records, where in iter_batches(unit, schema):
            docs += [d for d in enc.encode(records, where) if d is not None]
    return TokenStore.from_documents(docs, name=src.name, eos_id=eos_id, has_mask=enc.has_mask)


def open_dataset(cfg: DataConfig, *, vocab_size: int, eos_id: int | None = None, pad_id: int | None = None) -> Dataset:
    """The dataset of ``cfg``: prepared folders are read on demand (start-up reads only their headers); raw files
    are tokenised in memory at start-up, on every rank (for small data; prepare anything large).

    Args:
        vocab_size: the model's vocabulary; a token id at or above it is an error.
        eos_id: EOS appended to raw ``input_ids`` records when no tokenizer is set (with a tokenizer, its EOS).
        pad_id: padding for ``packing: false`` (default: EOS, else 0).

    Raises:
        DataError: any bad input (each message names the file/record/key and the fix).
    """
    if cfg.synthetic:
        store = _synthetic_store(cfg, vocab_size)
        return Dataset([RowSource(store, cfg.seq_len, True, 0)], [1.0], shuffle=cfg.shuffle, seed=cfg.seed)
    sources = []
    for src in cfg.source_list():
        files, prepared = resolve(src.path)
        if files and prepared:
            raise DataError(
                f"source {src.name!r} mixes prepared folders ({prepared[0]}) and raw files ({files[0].path}); "
                "prepare the raw files too, or make them separate sources"
            )
        store = TokenStore.open(prepared, src.name) if prepared else _raw_store(src, files, cfg, vocab_size, eos_id)
        if store.max_token_id >= vocab_size:
            raise DataError(
                f"source {src.name!r} holds token id {store.max_token_id}, outside the model's vocabulary "
                f"[0, {vocab_size}); it was tokenised for another model: re-prepare it with this model's tokenizer"
            )
        pad = pad_id if pad_id is not None else (store.eos_id if store.eos_id is not None else 0)
        rows = RowSource(store, cfg.seq_len, cfg.packing, pad)
        if rows.num_rows == 0:
            raise DataError(
                f"source {src.name!r}: {store.num_tokens} tokens make no row of data.seq_len {cfg.seq_len}; "
                "add data or lower data.seq_len"
            )
        sources.append(rows)
    weights = [s.weight for s in cfg.source_list()]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise DataError(f"data.sources: every weight must be > 0, got {weights}")
    return Dataset(sources, weights, shuffle=cfg.shuffle, seed=cfg.seed)
