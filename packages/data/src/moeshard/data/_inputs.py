"""Raw corpora: resolving paths to files, probing their schema, cutting them into work units, reading records.

Formats: JSONL (``.jsonl``/``.json``/``.ndjson``, optionally ``.gz``), Parquet, and Arrow IPC streams as written by
HF ``datasets`` ``save_to_disk`` (a folder with ``state.json``; read with pyarrow, ``datasets`` is not needed).
A record is one of three *kinds*, decided by its fields (the first match wins):

- ``tokens``: ``input_ids`` (list of ints), optionally ``labels`` (-100 or the id) or ``loss_mask`` (0/1);
- ``messages``: a conversation rendered by the tokenizer's chat template, loss on assistant tokens;
- ``text``: plain text.

Every record of a source has the kind (and mask field) of its first record; a file that differs is a "mixed
schema" error, found from each file's first record or Parquet/Arrow schema before anything is written.
"""

from __future__ import annotations

import glob as globlib
import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeshard.data._errors import DataError

FORMAT_SUFFIXES = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".json.gz": "jsonl.gz",
    ".ndjson.gz": "jsonl.gz",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
PREPARED_HEADER = "header.json"
PREPARED_FORMAT = "moeshard-tokens"
BATCH_RECORDS = 1024
_GZ_ERRORS = (OSError, EOFError, zlib.error)
FIX_FILE = "re-create or remove the file"


@dataclass(frozen=True)
class InputFile:
    """One raw file: its path, format and size in bytes."""

    path: str
    format: str
    size: int


@dataclass(frozen=True)
class Schema:
    """A source's record kind (``text``, ``messages``, ``tokens``) and mask field (``labels``/``loss_mask``/None)."""

    kind: str
    mask_field: str | None = None

    @property
    def columns(self) -> list[str]:
        """The fields a reader needs."""
        main = {"text": "text", "messages": "messages", "tokens": "input_ids"}[self.kind]
        return [main] + ([self.mask_field] if self.mask_field else [])


def file_format(path: str) -> str | None:
    """The format of ``path`` from its name, or None."""
    name = path.lower()
    for suffix in sorted(FORMAT_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return FORMAT_SUFFIXES[suffix]
    return None


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``prepare``."""
    header = Path(path) / PREPARED_HEADER
    if not header.is_file():
        return False
    try:
        return json.loads(header.read_text()).get("format") == PREPARED_FORMAT
    except (OSError, ValueError):
        return False


def _check_readable(path: str) -> int:
    if not os.path.exists(path):
        kind = "is a broken link" if os.path.islink(path) else "does not exist"
        raise DataError(f"{path} {kind}; fix the path or remove it from the input")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e}); fix its permissions or remove it") from None
    return os.path.getsize(path)


def _datasets_folder(folder: Path) -> list[str]:
    state = json.loads((folder / "state.json").read_text())
    return [str(folder / f["filename"]) for f in state.get("_data_files", [])]


def _expand_one(entry: str) -> tuple[list[str], list[str]]:
    """``(files, prepared folders)`` that one path entry names."""
    if any(c in entry for c in "*?["):
        matches = sorted(globlib.glob(entry, recursive=True))
        if not matches:
            raise DataError(f"{entry}: the pattern matches no file; fix the pattern")
        files, prepared = [], []
        for m in matches:
            if os.path.isdir(m) and not os.path.islink(m):
                f, p = _expand_one(m)
                files += f
                prepared += p
            else:
                files.append(m)
        return files, prepared
    p = Path(entry)
    if p.is_dir():
        if is_prepared(p):
            return [], [str(p)]
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise DataError(
                f"{entry} is a datasets DatasetDict with splits {splits}; point at one split, e.g. {p / splits[0]}"
                if splits
                else f"{entry} is an empty datasets DatasetDict"
            )
        if (p / "state.json").is_file():
            return _datasets_folder(p), []
        found = sorted(
            str(Path(root) / name) for root, _, names in os.walk(p) for name in names if file_format(name) is not None
        )
        if not found:
            raise DataError(f"{entry}: the folder holds no .jsonl, .jsonl.gz, .parquet or .arrow file")
        return found, []
    return [entry], []


def resolve(path: str | Sequence[str]) -> tuple[list[InputFile], list[str]]:
    """Raw files and prepared folders named by a path, directory, glob or list of them, in the given order.

    Raises:
        DataError: a missing/unreadable file, a pattern matching nothing, an unknown file type, a DatasetDict.
    """
    entries = [path] if isinstance(path, str) else list(path)
    files: list[InputFile] = []
    prepared: list[str] = []
    for entry in entries:
        names, folders = _expand_one(str(entry))
        prepared += folders
        for name in names:
            fmt = file_format(name)
            if fmt is None:
                raise DataError(
                    f"{name}: unknown file type; use .jsonl, .jsonl.gz, .parquet, .arrow or a datasets folder"
                )
            files.append(InputFile(name, fmt, _check_readable(name)))
    return files, prepared


# ---- schema ------------------------------------------------------------------------------------------------------


def schema_of_fields(fields: Sequence[str]) -> Schema | None:
    """The schema a record (or table) with these fields has, or None when it has none of the known fields."""
    if "input_ids" in fields:
        mask = "labels" if "labels" in fields else "loss_mask" if "loss_mask" in fields else None
        return Schema("tokens", mask)
    if "messages" in fields:
        return Schema("messages")
    if "text" in fields:
        return Schema("text")
    return None


def _first_json(lines: Iterator[bytes], where: str) -> dict | None:
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            return _parse_line(line, f"{where}:{lineno}")
    return None


def probe(f: InputFile) -> Schema | None:
    """The schema of ``f``'s first record (None for an empty file); opens Parquet footers and gzip headers.

    Raises:
        DataError: a corrupt file, invalid JSON, or a first record with none of the known fields.
    """
    if f.format == "jsonl":
        with open(f.path, "rb") as fh:
            rec = _first_json(iter(fh), f.path)
        fields = None if rec is None else list(rec)
    elif f.format == "jsonl.gz":
        try:
            with gzip.open(f.path, "rb") as fh:
                rec = _first_json(iter(fh), f.path)
        except _GZ_ERRORS as e:
            raise DataError(f"{f.path}: corrupt or truncated gzip ({e}); {FIX_FILE}") from None
        fields = None if rec is None else list(rec)
    elif f.format == "parquet":
        pf = _parquet(f.path)
        fields = None if pf.metadata.num_rows == 0 else pf.schema_arrow.names
    else:
        reader = _arrow_reader(f.path)
        fields = reader.schema.names
    if fields is None:
        return None
    schema = schema_of_fields(fields)
    if schema is None:
        raise DataError(
            f"{f.path}: records have none of the fields 'text', 'messages', 'input_ids' (fields: {sorted(fields)}); "
            "rename the column holding the documents to 'text'"
        )
    return schema


def source_schema(files: Sequence[InputFile], what: str) -> Schema:
    """The one schema of all non-empty ``files`` of a source.

    Raises:
        DataError: mixed schemas, or no record at all (an empty source).
    """
    first: tuple[InputFile, Schema] | None = None
    for f in files:
        s = probe(f)
        if s is None:
            continue
        if first is None:
            first = (f, s)
        elif s != first[1]:
            raise DataError(
                f"{what}: mixed schemas: {first[0].path} holds {_describe(first[1])} but {f.path} holds "
                f"{_describe(s)}; put them in separate sources (data.sources) or prepare them separately"
            )
    if first is None:
        raise DataError(f"{what}: empty source (no record in {len(files)} file(s)); add data or drop the source")
    return first[1]


def _describe(s: Schema) -> str:
    return f"'{s.columns[0]}'" + (f" with '{s.mask_field}'" if s.mask_field else "")


# ---- work units and readers ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """A piece of one file tokenised into one shard: bytes ``[start, stop)`` of a plain JSONL file, row groups
    ``[start, stop)`` of a Parquet file, or the whole file (``start = stop = -1``, gzip and Arrow)."""

    file: InputFile
    start: int
    stop: int
    weight: int  # bytes, for the progress bar

    def describe(self) -> dict[str, Any]:
        """What identifies the unit's content (a finished shard is reused only when this matches)."""
        st = os.stat(self.file.path)
        return {
            "path": self.file.path,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "range": [self.start, self.stop],
        }


def plan_units(files: Sequence[InputFile], chunk_bytes: int) -> list[Unit]:
    """Cut ``files`` into units of about ``chunk_bytes`` where the format allows it (empty files give none)."""
    units = []
    for f in files:
        if f.format == "jsonl":
            units += [
                Unit(f, a, min(a + chunk_bytes, f.size), min(chunk_bytes, f.size - a))
                for a in range(0, f.size, chunk_bytes)
            ]
        elif f.format == "parquet":
            meta = _parquet(f.path).metadata
            start, acc = 0, 0
            for rg in range(meta.num_row_groups):
                acc += meta.row_group(rg).total_byte_size
                if acc >= chunk_bytes or rg == meta.num_row_groups - 1:
                    units.append(Unit(f, start, rg + 1, acc))
                    start, acc = rg + 1, 0
        elif f.size > 0:
            units.append(Unit(f, -1, -1, f.size))
    return units


def _parse_line(line: bytes, where: str) -> dict:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not valid JSON ({e}); each line must be one JSON object") from None
    if not isinstance(rec, dict):
        raise DataError(f"{where}: each line must be a JSON object, got {type(rec).__name__}")
    return rec


def _line_number(path: str, offset: int) -> int:
    n = 1
    with open(path, "rb") as fh:
        while offset > 0:
            block = fh.read(min(offset, 1 << 20))
            if not block:
                break
            n += block.count(b"\n")
            offset -= len(block)
    return n


def _parquet(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}); {FIX_FILE}") from None


def _arrow_reader(path: str):
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(path))
    except (pa.ArrowException, OSError):
        try:
            return pa.ipc.open_file(pa.memory_map(path))
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Arrow file ({e}); {FIX_FILE}") from None


Where = Callable[[int], str]  # record index in the batch -> "file:line" / "file: row N"


def iter_batches(unit: Unit, schema: Schema) -> Iterator[tuple[list[dict], Where]]:
    """Record batches of ``unit`` with a function naming each record's place (for error messages).

    Raises:
        DataError: invalid JSON, a corrupt file, a record that is not an object.
    """
    f = unit.file
    if f.format == "jsonl":
        yield from _jsonl_range(f.path, unit.start, unit.stop)
    elif f.format == "jsonl.gz":
        try:
            yield from _jsonl_gz(f.path)
        except _GZ_ERRORS as e:
            raise DataError(f"{f.path}: corrupt or truncated gzip ({e}); {FIX_FILE}") from None
    else:
        yield from _arrow_batches(unit, schema)


def _jsonl_range(path: str, start: int, stop: int) -> Iterator[tuple[list[dict], Where]]:
    # A line belongs to the unit in which its first byte lies.
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()
        pos = fh.tell()
        recs: list[dict] = []
        offsets: list[int] = []
        while pos < stop:
            line = fh.readline()
            if not line:
                break
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict):  # count lines (slow) only to name a bad one
                    _parse_line(line, f"{path}:{_line_number(path, pos)}")
                recs.append(rec)
                offsets.append(pos)
            pos += len(line)
            if len(recs) == BATCH_RECORDS:
                yield recs, _jsonl_where(path, offsets)
                recs, offsets = [], []
        if recs:
            yield recs, _jsonl_where(path, offsets)


def _jsonl_where(path: str, offsets: list[int]) -> Where:
    return lambda i: f"{path}:{_line_number(path, offsets[i])}"


def _jsonl_gz(path: str) -> Iterator[tuple[list[dict], Where]]:
    with gzip.open(path, "rb") as fh:
        recs: list[dict] = []
        lines: list[int] = []
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                recs.append(_parse_line(line, f"{path}:{lineno}"))
                lines.append(lineno)
            if len(recs) == BATCH_RECORDS:
                yield recs, (lambda i, ln=lines: f"{path}:{ln[i]}")
                recs, lines = [], []
        if recs:
            yield recs, (lambda i, ln=lines: f"{path}:{ln[i]}")


def _arrow_batches(unit: Unit, schema: Schema) -> Iterator[tuple[list[dict], Where]]:
    import pyarrow as pa

    path = unit.file.path
    cols = schema.columns
    try:
        if unit.file.format == "parquet":
            pf = _parquet(path)
            first = sum(pf.metadata.row_group(i).num_rows for i in range(unit.start))
            missing = [c for c in cols if c not in pf.schema_arrow.names]
            batches = pf.iter_batches(batch_size=BATCH_RECORDS, row_groups=range(unit.start, unit.stop), columns=cols)
        else:
            reader = _arrow_reader(path)
            first = 0
            missing = [c for c in cols if c not in reader.schema.names]
            batches = (b.select(cols) for b in reader)
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r}; every file of a source needs the same columns")
        for batch in batches:
            recs = batch.to_pylist()
            yield recs, (lambda i, base=first: f"{path}: row {base + i}")
            first += len(recs)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: corrupt file ({e}); {FIX_FILE}") from None
