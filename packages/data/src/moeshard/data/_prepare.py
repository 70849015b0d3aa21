"""Prepare: tokenise a raw corpus once, in parallel, resumably, into the flat token format (``_format``).

    python -m moeshard.data prepare --input 'corpus/*.jsonl.gz' --tokenizer TOKENIZER_DIR --output prepared/ \\
        [--workers 16]

Order of work: (1) validate everything that can be checked without tokenising (paths, readability, Parquet
footers and gzip headers, every file's schema, the tokenizer, the output folder) -- nothing is written before this
passes; (2) cut the inputs into units (~64 MiB of JSONL, groups of Parquet row groups, whole gzip/Arrow files);
(3) tokenise the units not finished yet over a process pool, each into a shard written atomically; (4) write
``header.json``. A bad record found while tokenising stops the run with its file and line; the shards finished
so far stay, and a re-run after the fix redoes only the units whose shard is missing or whose input changed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeshard.data._errors import DataError
from moeshard.data._format import (
    FORMAT_VERSION,
    TOKEN_DTYPE,
    read_json,
    shard_file,
    shard_problem,
    write_json,
    write_shard,
)
from moeshard.data._inputs import (
    PREPARED_FORMAT,
    PREPARED_HEADER,
    Unit,
    iter_batches,
    plan_units,
    resolve,
    source_schema,
)
from moeshard.data._tokenize import EncodeOptions, Encoder, load_tokenizer, tokenizer_fingerprint

MANIFEST = "prepare.json"


@dataclass(frozen=True)
class PrepareResult:
    """What a prepare run did: the folder, totals, and how many shards it wrote and reused."""

    output: Path
    num_tokens: int
    num_documents: int
    shards_written: int
    shards_reused: int
    seconds: float
    header: dict[str, Any]


def prepare(
    inputs: str | Sequence[str],
    output: str | Path,
    *,
    tokenizer: str | None = None,
    workers: int | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    append_eos: bool = True,
    chunk_mb: float = 64,
    progress: bool | None = None,
    start_method: str | None = None,
) -> PrepareResult:
    """Tokenise ``inputs`` (file, folder, glob, or a list) into the token format in ``output``.

    Args:
        tokenizer: a local tokenizer folder; needed for ``text``/``messages`` records.
        workers: processes (default: all CPU cores); 1 runs in this process.
        eos_id: the EOS appended after each document (default: the tokenizer's).
        vocab_size: token ids must be below it (default: the tokenizer's size; unchecked without either).
        append_eos: append EOS after every document (off: documents are still delimited by the index).
        chunk_mb: JSONL/Parquet inputs are cut into units of about this size (one shard each).
        progress: a progress bar on stderr (default: when stderr is a terminal).
        start_method: how worker processes start (``fork``, ``spawn``, ``forkserver``); default ``fork`` when this
            process runs no other thread (workers start in milliseconds), else ``spawn`` (forking a process with
            threads can deadlock; spawned workers re-import torch and transformers, seconds each).

    Raises:
        DataError: bad input, found before anything is written; or a bad record found while tokenising (the
            finished shards stay; a re-run after the fix resumes).
    """
    t0 = time.perf_counter()
    out = Path(output)
    # ---- (1) validation: nothing is written before it passes
    files, prepared = resolve(inputs)
    if prepared:
        raise DataError(f"{prepared[0]} is already prepared; train on it directly (data.path)")
    schema = source_schema(files, "input")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is None and schema.kind != "tokens":
        raise DataError(
            f"the input holds '{schema.columns[0]}' records; pass --tokenizer with a local tokenizer folder"
        )
    if eos_id is None and tok is not None:
        eos_id = tok.eos_token_id
    if append_eos and eos_id is None:
        raise DataError("no EOS id: the tokenizer has none and --eos-id is not given; pass --eos-id N or --no-eos")
    vocab_limit = vocab_size if vocab_size is not None else (len(tok) if tok is not None else None)
    if schema.kind == "messages":
        Encoder(EncodeOptions(schema, tokenizer, eos_id, vocab_limit), tokenizer=tok).turn_end  # noqa: B018 (checks the template)
    opts = EncodeOptions(schema, tokenizer, eos_id, vocab_limit, append_eos)
    units = plan_units(files, max(1 << 12, int(chunk_mb * (1 << 20))))
    tok_info = None
    if tok is not None:
        tok_info = {
            "path": str(Path(tokenizer).resolve()),
            "name_or_path": str(getattr(tok, "name_or_path", tokenizer)),
            "vocab_size": len(tok),
            "eos_id": tok.eos_token_id,
            "fingerprint": tokenizer_fingerprint(tokenizer),
        }
    manifest = {
        "format": PREPARED_FORMAT,
        "version": FORMAT_VERSION,
        "kind": schema.kind,
        "mask_field": schema.mask_field,
        "tokenizer": tok_info,
        "eos_id": eos_id,
        "append_eos": append_eos,
        "vocab_limit": vocab_limit,
    }
    _check_output(out, manifest)
    # ---- (2) plan, (3) tokenise the missing shards
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / MANIFEST, manifest)
    (out / PREPARED_HEADER).unlink(missing_ok=True)  # the folder is a corpus again only when this run finishes
    descs = [u.describe() for u in units]
    has_mask = schema.kind == "messages" or schema.mask_field is not None

    def finished(i: int) -> bool:
        meta = read_json(shard_file(out, i, "json"))
        return meta is not None and meta.get("unit") == descs[i] and shard_problem(out, meta, has_mask) is None

    todo = [i for i in range(len(units)) if not finished(i)]
    for stale in out.glob("shard-*"):  # shards of units that no longer exist (the inputs changed)
        if int(stale.name[6:11]) >= len(units):
            stale.unlink()
    show = sys.stderr.isatty() if progress is None else progress
    _run(out, opts, units, todo, descs, workers or os.cpu_count() or 1, show, start_method)
    # ---- (4) the header
    metas = [read_json(shard_file(out, i, "json")) for i in range(len(units))]
    assert all(m is not None for m in metas), "a shard is missing after the run"
    fp = hashlib.blake2b(digest_size=16)
    for m in metas:
        fp.update(m["fingerprint"].encode())
    header = {
        **manifest,
        "dtype": TOKEN_DTYPE,
        "has_loss_mask": has_mask,
        "num_tokens": sum(m["num_tokens"] for m in metas),
        "num_documents": sum(m["num_documents"] for m in metas),
        "max_token_id": max((m["max_token_id"] for m in metas), default=-1),
        "inputs": [f.path for f in files],
        "shards": [{k: m[k] for k in ("index", "num_tokens", "num_documents", "fingerprint")} for m in metas],
        "fingerprint": fp.hexdigest(),
    }
    if header["num_documents"] == 0:
        raise DataError(f"input {inputs!r}: every record is empty; nothing to prepare")
    write_json(out / PREPARED_HEADER, header)
    n_new = len(todo)
    return PrepareResult(
        out, header["num_tokens"], header["num_documents"], n_new, len(units) - n_new, time.perf_counter() - t0, header
    )


def _check_output(out: Path, manifest: dict) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file; pass a folder (new or from an earlier prepare run)")
    if not out.is_dir() or not any(out.iterdir()):
        return
    old = read_json(out / MANIFEST)
    if old is None:
        raise DataError(f"output {out} is not empty and holds no {MANIFEST}; pass a new or empty folder")
    diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
    if diff:
        raise DataError(
            f"output {out} holds a preparation with other options ({', '.join(diff)}); pass a new folder, or delete it"
        )


# ---- the work -----------------------------------------------------------------------------------------------------

_worker_encoder: Encoder | None = None  # one per pool process: the tokenizer is loaded once, not per unit


def _init_worker(opts: EncodeOptions) -> None:
    global _worker_encoder
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
    _worker_encoder = Encoder(opts)


def _tokenise_unit(enc: Encoder, out: Path, index: int, unit: Unit, desc: dict) -> tuple[int, int, int]:
    docs = []
    for records, where in iter_batches(unit, enc.opts.schema):
        docs += [d for d in enc.encode(records, where) if d is not None]
    meta = write_shard(out, index, docs, enc.has_mask, desc)
    return index, meta["num_tokens"], unit.weight


def _work(args: tuple[Path, int, Unit, dict]) -> tuple[int, int, int]:
    assert _worker_encoder is not None
    return _tokenise_unit(_worker_encoder, *args)


def _run(
    out: Path,
    opts: EncodeOptions,
    units: list[Unit],
    todo: list[int],
    descs: list[dict],
    workers: int,
    show: bool,
    start_method: str | None,
) -> None:
    bar = None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional (the `tokenize` extra brings tqdm)
        show = False
    if show:
        total = sum(u.weight for u in units)
        bar = tqdm(
            total=total,
            initial=total - sum(units[i].weight for i in todo),
            unit="B",
            unit_scale=True,
            desc="prepare",
            file=sys.stderr,
        )
    tokens = 0

    def done(result: tuple[int, int, int]) -> None:
        nonlocal tokens
        tokens += result[1]
        if bar is not None:
            bar.update(result[2])
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)

    jobs = [(out, i, units[i], descs[i]) for i in todo]
    try:
        if workers <= 1 or len(jobs) <= 1:
            enc = Encoder(opts)
            for job in jobs:
                done(_tokenise_unit(enc, *job))
        else:
            if start_method is None:
                safe_fork = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
                start_method = "fork" if safe_fork else "spawn"
            ctx = multiprocessing.get_context(start_method)
            with ctx.Pool(min(workers, len(jobs)), initializer=_init_worker, initargs=(opts,)) as pool:
                for result in pool.imap_unordered(_work, jobs):
                    done(result)
    finally:
        if bar is not None:
            bar.close()
