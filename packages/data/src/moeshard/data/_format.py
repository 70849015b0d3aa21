"""The prepared token format, and the token stores that read it (positioned reads) or hold raw data (in memory).

A prepared folder::

    header.json            format, version, dtype, tokenizer (path, vocab size, eos id, fingerprint), counts,
                           max token id, shards (tokens, documents, fingerprint each), content fingerprint
    prepare.json           the options of the run (what a resumed run must match)
    shard-00000.tokens     uint32, the documents' tokens back to back (EOS included)
    shard-00000.docs       int64, the end offset of each document within the shard (cumulative lengths)
    shard-00000.mask       uint8 loss mask, one per token (only for chat / labelled sources)
    shard-00000.json       the shard's counts and fingerprint, and the input unit it came from; written last,
                           so a shard is finished exactly when its .json exists

Files are written under a temporary name and renamed (atomic). A store is the shards of one or more folders read
as one token stream; opening one reads the headers only; rows are read with positioned reads (see ``_Shard``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeshard.data._errors import DataError
from moeshard.data._inputs import PREPARED_FORMAT, PREPARED_HEADER

FORMAT_VERSION = 1
TOKEN_DTYPE = "uint32"


def shard_file(folder: str | Path, index: int, ext: str) -> Path:
    """``folder/shard-00007.<ext>``."""
    return Path(folder) / f"shard-{index:05d}.{ext}"


def write_atomic(path: Path, data: bytes | np.ndarray) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, np.ndarray):
            data.tofile(f)
        else:
            f.write(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def write_shard(
    folder: Path, index: int, docs: Sequence[tuple[np.ndarray, np.ndarray | None]], has_mask: bool, unit: dict
) -> dict[str, Any]:
    """Write one shard of documents (atomic; the .json last) and return its metadata."""
    lengths = np.fromiter((d[0].size for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.concatenate([d[0] for d in docs]).astype(np.uint32) if docs else np.zeros(0, np.uint32)
    ends = np.cumsum(lengths, dtype=np.int64)
    h = hashlib.blake2b(digest_size=16)
    h.update(tokens.tobytes())
    h.update(ends.tobytes())
    write_atomic(shard_file(folder, index, "tokens"), tokens)
    write_atomic(shard_file(folder, index, "docs"), ends)
    if has_mask:
        mask = np.concatenate([d[1] for d in docs]).astype(np.uint8) if docs else np.zeros(0, np.uint8)
        h.update(mask.tobytes())
        write_atomic(shard_file(folder, index, "mask"), mask)
    meta = {
        "index": index,
        "num_tokens": int(tokens.size),
        "num_documents": int(lengths.size),
        "max_token_id": int(tokens.max()) if tokens.size else -1,
        "fingerprint": h.hexdigest(),
        "unit": unit,
    }
    write_json(shard_file(folder, index, "json"), meta)
    return meta


def shard_problem(folder: str | Path, meta: dict, has_mask: bool) -> str | None:
    """What is wrong with a shard's files given its metadata (a missing or truncated file), or None."""
    want = {"tokens": meta["num_tokens"] * 4, "docs": meta["num_documents"] * 8}
    if has_mask:
        want["mask"] = meta["num_tokens"]
    for ext, size in want.items():
        path = shard_file(folder, meta["index"], ext)
        have = path.stat().st_size if path.is_file() else None
        if have != size:
            return f"{path}: {'missing' if have is None else f'{have} bytes'}, expected {size} bytes"
    return None


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when missing or unreadable (a torn write counts as missing)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pread(path: str, dtype: np.dtype, start: int, stop: int, fd: int | None = None) -> np.ndarray:
    """Elements ``[start, stop)`` of a flat binary file (a positioned read: nothing stays mapped in the process)."""
    size = np.dtype(dtype).itemsize
    own = fd is None
    fd = os.open(path, os.O_RDONLY) if own else fd
    try:
        data = os.pread(fd, (stop - start) * size, start * size)
    finally:
        if own:
            os.close(fd)
    return np.frombuffer(data, dtype=dtype)


@dataclass
class _Shard:
    """One shard: in-memory arrays, or the paths of its files (read by positioned reads, never mapped).

    Files are read with ``pread`` rather than ``np.memmap``: a mapping keeps every page it touched resident in the
    process (and kernels with large page-cache folios map up to 2 MiB per touched 16 KiB row), so a rank's RSS
    would grow with the rows it has read; reads leave the data in the kernel's page cache only.
    """

    tokens: np.ndarray | str
    ends: np.ndarray | str  # cumulative document ends within the shard
    mask: np.ndarray | str | None
    num_tokens: int
    num_docs: int

    def read(self, which: str, start: int, stop: int) -> np.ndarray:
        src = getattr(self, which)
        if isinstance(src, np.ndarray):
            return src[start:stop]
        return _pread(src, {"tokens": np.uint32, "ends": np.int64, "mask": np.uint8}[which], start, stop)

    def ends_inside(self, a: int, b: int) -> np.ndarray:
        """Document ends ``e`` with ``a < e < b`` (the starts of the documents that begin inside ``(a, b)``)."""
        if isinstance(self.ends, np.ndarray):
            i, j = np.searchsorted(self.ends, a, side="right"), np.searchsorted(self.ends, b, side="left")
            return self.ends[i:j]
        fd = os.open(self.ends, os.O_RDONLY)
        try:
            lo, hi = 0, self.num_docs  # binary search for the first end > a, one 8-byte read per probe
            while lo < hi:
                mid = (lo + hi) // 2
                if int(_pread(self.ends, np.int64, mid, mid + 1, fd)[0]) > a:
                    hi = mid
                else:
                    lo = mid + 1
            out, chunk = [], 64
            while lo < self.num_docs:
                block = _pread(self.ends, np.int64, lo, min(lo + chunk, self.num_docs), fd)
                inside = block[block < b]
                out.append(inside)
                if inside.size < block.size:
                    break
                lo, chunk = lo + block.size, chunk * 4
        finally:
            os.close(fd)
        return np.concatenate(out) if out else np.zeros(0, np.int64)


class TokenStore:
    """A token stream of documents over shards: windows with document starts, and whole documents.

    Read-only; shards with no token are dropped. ``has_mask``: whether any shard carries a loss mask (a shard
    without one trains on all its tokens).
    """

    def __init__(self, shards: list[_Shard], *, name: str, eos_id: int | None, max_token_id: int, fingerprint: str):
        self.shards = [s for s in shards if s.num_tokens > 0]
        self.name, self.eos_id, self.max_token_id, self.fingerprint = name, eos_id, max_token_id, fingerprint
        self.has_mask = any(s.mask is not None for s in self.shards)
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.num_tokens for s in self.shards], out=self.starts[1:])

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream."""
        return int(self.starts[-1])

    @property
    def num_documents(self) -> int:
        """Documents in the stream."""
        return sum(s.num_docs for s in self.shards)

    @classmethod
    def open(cls, folders: Sequence[str], name: str) -> TokenStore:
        """The shards of prepared folders, as one stream in the given order (reads the headers only).

        Raises:
            DataError: a folder without a finished header, or of another format version.
        """
        shards, eos, max_id, h = [], None, -1, hashlib.blake2b(digest_size=16)
        for folder in folders:
            header = read_json(Path(folder) / PREPARED_HEADER)
            if header is None or header.get("format") != PREPARED_FORMAT:
                raise DataError(f"{folder}: not a finished prepared folder (no header.json); run prepare again")
            if header.get("version") != FORMAT_VERSION or header.get("dtype") != TOKEN_DTYPE:
                raise DataError(
                    f"{folder}: token format version {header.get('version')} / {header.get('dtype')} is not "
                    f"{FORMAT_VERSION} / {TOKEN_DTYPE}; prepare the corpus again with this version"
                )
            for s in header["shards"]:
                i = s["index"]
                bad = shard_problem(folder, s, header["has_loss_mask"])
                if bad:
                    raise DataError(f"{bad}; run prepare on the same input into {folder} again (it redoes that shard)")
                mask = str(shard_file(folder, i, "mask")) if header["has_loss_mask"] else None
                files = (str(shard_file(folder, i, "tokens")), str(shard_file(folder, i, "docs")))
                shards.append(_Shard(*files, mask, s["num_tokens"], s["num_documents"]))
            eos = header["eos_id"] if eos is None else eos
            max_id = max(max_id, header["max_token_id"])
            h.update(header["fingerprint"].encode())
        return cls(shards, name=name, eos_id=eos, max_token_id=max_id, fingerprint=h.hexdigest())

    @classmethod
    def from_documents(
        cls, docs: Sequence[tuple[np.ndarray, np.ndarray | None]], *, name: str, eos_id: int | None, has_mask: bool
    ) -> TokenStore:
        """An in-memory store of documents (raw sources tokenised at start-up, synthetic data)."""
        tokens = np.concatenate([d[0] for d in docs]).astype(np.uint32) if docs else np.zeros(0, np.uint32)
        ends = np.cumsum([d[0].size for d in docs], dtype=np.int64)
        mask = np.concatenate([d[1] for d in docs]).astype(np.uint8) if has_mask and docs else None
        h = hashlib.blake2b(tokens.tobytes(), digest_size=16)
        h.update(ends.tobytes())
        if mask is not None:
            h.update(mask.tobytes())
        max_id = int(tokens.max()) if tokens.size else -1
        return cls(
            [_Shard(tokens, ends, mask, int(tokens.size), int(ends.size))],
            name=name,
            eos_id=eos_id,
            max_token_id=max_id,
            fingerprint=h.hexdigest(),
        )

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Tokens ``[start, stop)`` of the stream (int64), their loss mask (bool, None: all targets), and the
        offsets within the window where a document (or a piece of one) starts: always 0, then each document
        start inside the window (shard boundaries are document boundaries)."""
        if start < 0 or stop > self.num_tokens or start >= stop:
            raise IndexError(f"window [{start}, {stop}) outside the {self.num_tokens} tokens of {self.name}")
        k0 = int(np.searchsorted(self.starts, start, side="right")) - 1
        toks, masks, cuts = [], [], [np.zeros(1, np.int64)]
        pos, k = start, k0
        while pos < stop:
            shard = self.shards[k]
            base = int(self.starts[k])
            a, b = pos - base, min(stop, int(self.starts[k + 1])) - base
            toks.append(shard.read("tokens", a, b).astype(np.int64))
            if self.has_mask:
                masks.append(shard.read("mask", a, b).astype(bool) if shard.mask is not None else np.ones(b - a, bool))
            # document ends strictly inside (a, b) are starts of the next document
            inner = np.asarray(shard.ends_inside(a, b), dtype=np.int64) + (base - start)
            if pos > start:
                inner = np.concatenate([[pos - start], inner])
            cuts.append(inner)
            pos, k = base + b, k + 1
        starts = np.unique(np.concatenate(cuts))
        return np.concatenate(toks), (np.concatenate(masks) if self.has_mask else None), starts

    def document_lengths(self) -> np.ndarray:
        """Every document's length (int64; reads the whole document index: for padded rows, not for packing)."""
        parts = []
        for s in self.shards:
            parts.append(np.diff(np.asarray(s.read("ends", 0, s.num_docs), dtype=np.int64), prepend=0))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
