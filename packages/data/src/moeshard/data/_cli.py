"""Command line: ``python -m moeshard.data prepare ...`` (tokenise a corpus) and ``... inspect DIR``.

python -m moeshard.data prepare --input 'corpus/*.parquet' --tokenizer ./qwen3-tokenizer --output ./prepared
python -m moeshard.data inspect ./prepared
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeshard.data._errors import DataError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also usable as a sub-command parser by an application)."""
    p = argparse.ArgumentParser(prog="python -m moeshard.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="tokenise a corpus into the flat token format (resumable)")
    prep.add_argument("--input", nargs="+", required=True, help="files, folders or globs (quote the globs)")
    prep.add_argument("--output", required=True, help="the output folder (new, or of an interrupted run)")
    prep.add_argument("--tokenizer", help="a local tokenizer folder (needed for text and messages records)")
    prep.add_argument("--workers", type=int, default=None, help="processes (default: all CPU cores)")
    prep.add_argument("--eos-id", type=int, default=None, help="EOS after each document (default: the tokenizer's)")
    prep.add_argument("--no-eos", action="store_true", help="do not append EOS after documents")
    prep.add_argument("--vocab-size", type=int, default=None, help="token ids must be below this")
    prep.add_argument("--chunk-mb", type=float, default=64, help="input MiB per shard for JSONL/Parquet (default 64)")
    prep.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar")
    insp = sub.add_parser("inspect", help="print a prepared folder's header")
    insp.add_argument("folder")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command line; a ``DataError`` prints one line on stderr and returns 2."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare":
            from moeshard.data._prepare import prepare

            r = prepare(
                args.input,
                args.output,
                tokenizer=args.tokenizer,
                workers=args.workers,
                eos_id=args.eos_id,
                vocab_size=args.vocab_size,
                append_eos=not args.no_eos,
                chunk_mb=args.chunk_mb,
                progress=args.progress,
            )
            print(
                f"{r.output}: {r.num_tokens:,} tokens in {r.num_documents:,} documents, "
                f"{r.shards_written} shard(s) written, {r.shards_reused} reused, {r.seconds:.1f} s"
            )
        else:
            from moeshard.data._format import read_json
            from moeshard.data._inputs import PREPARED_HEADER, is_prepared

            if not is_prepared(args.folder):
                raise DataError(f"{args.folder}: not a prepared folder (no finished header.json)")
            header = read_json(Path(args.folder) / PREPARED_HEADER)
            header["shards"] = f"{len(header['shards'])} shards"
            print(json.dumps(header, indent=1))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
