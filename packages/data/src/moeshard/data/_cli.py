"""Command line: ``python -m moeshard.data prepare ...`` (tokenise a corpus) and ``... inspect DIR``.

python -m moeshard.data prepare --input 'corpus/*.parquet' --tokenizer ./qwen3-tokenizer --output ./prepared
python -m moeshard.data inspect ./prepared --rows 3

A failure is one line, ``moeshard.data: error: ...``, and an exit status of :class:`ExitStatus`: 2 for a bad input
(flags included), 1 for anything unexpected (``MOESHARD_TRACEBACK=1`` adds its traceback), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from moeshard.data._errors import DataError, ExitStatus, print_error

PROG = "moeshard.data"  # the prefix of this command line's error lines
TRAINED = ("[[", "]]")  # around the tokens that carry loss in `inspect --rows`


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a DataError (one line, status 2) instead of usage text and an exit."""

    def error(self, message: str) -> NoReturn:
        raise DataError(f"{message} (`{self.prog} --help` lists the options)")


def _add_prepare_flags(prep: argparse.ArgumentParser) -> None:
    prep.add_argument("--input", nargs="+", required=True, help="files, folders or globs (quote the globs)")
    prep.add_argument("--output", required=True, help="the output folder (new, or of an interrupted run)")
    prep.add_argument("--tokenizer", help="a local tokenizer folder (needed for text and messages records)")
    prep.add_argument("--workers", type=int, default=None, help="processes (default: all CPU cores)")
    prep.add_argument("--eos-id", type=int, default=None, help="EOS after each document (default: the tokenizer's)")
    prep.add_argument("--no-eos", action="store_true", help="do not append EOS after documents")
    prep.add_argument("--vocab-size", type=int, default=None, help="token ids must be below this")
    prep.add_argument("--chunk-mb", type=float, default=64, help="input MiB per shard for JSONL/Parquet (default 64)")
    prep.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m moeshard.data``; its usage errors raise :class:`DataError`."""
    p = _Parser(prog="python -m moeshard.data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    _add_prepare_flags(sub.add_parser("prepare", help="tokenise a corpus into the flat token format (resumable)"))
    insp = sub.add_parser("inspect", help="a prepared folder's header, and its first rows decoded (--rows N)")
    insp.add_argument("folder")
    insp.add_argument(
        "--rows",
        type=int,
        default=0,
        help=f"print the first N documents, decoded by the folder's tokenizer when it loads offline (else token "
        f"ids), the tokens that carry loss inside {TRAINED[0]} {TRAINED[1]}",
    )
    insp.add_argument("--max-tokens", type=int, default=256, help="tokens shown per row (default 256)")
    return p


def prepare_command(argv: list[str], *, prog: str) -> int:
    """``prepare``'s flags (``argv``) parsed and run, for an application that offers it as a command of its own.

    Args:
        prog: the command's name in its usage and help (e.g. ``moeshard-train prepare-data``).

    Returns:
        0 (``ExitStatus.OK``).

    Raises:
        DataError: a bad flag or input, in one line naming the fix; the caller reports it.
    """
    prep = _Parser(prog=prog, description="Tokenise a corpus into the flat token format (resumable).")
    _add_prepare_flags(prep)
    _prepare(prep.parse_args(argv))
    return ExitStatus.OK


def _prepare(args: argparse.Namespace) -> None:
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


def _inspect(args: argparse.Namespace) -> None:
    from moeshard.data._format import TokenStore, read_json
    from moeshard.data._inputs import PREPARED_HEADER, is_prepared

    if not is_prepared(args.folder):
        raise DataError(f"{args.folder}: not a prepared folder (no finished header.json); run prepare into it first")
    if args.rows < 0 or args.max_tokens < 1:
        raise DataError("inspect: --rows must be >= 0 and --max-tokens >= 1")
    header = read_json(Path(args.folder) / PREPARED_HEADER)
    shown = dict(header, shards=f"{len(header['shards'])} shards")
    print(json.dumps(shown, indent=1))
    if not args.rows:
        return
    store = TokenStore.open([args.folder], name=Path(args.folder).name)
    decode, how = _decoder((header.get("tokenizer") or {}).get("path"))
    lengths = store.document_lengths()[: args.rows]
    print(f"\nthe first {len(lengths)} of {store.num_documents} documents ({how}; {TRAINED[0]} {TRAINED[1]}: targets):")
    start = 0
    for i, n in enumerate(lengths.tolist()):
        shown_n = min(n, args.max_tokens)
        ids, mask, _ = store.window(start, start + n)
        targets = mask.tolist() if mask is not None else [True] * n  # no mask: every token carries loss
        more = f" ... (+{n - shown_n} tokens)" if n > shown_n else ""
        row = render_row(ids[:shown_n].tolist(), targets[:shown_n], decode)
        print(f"[{i}] {n} tokens, {sum(targets)} targets: {row}{more}")
        start += n


def _decoder(path: str | None):
    """``(decode(ids) -> str, description)``: the folder's tokenizer when it loads offline, else token ids."""
    if path and Path(path).is_dir():
        try:
            from moeshard.data._tokenize import load_tokenizer

            tok = load_tokenizer(path)
            return (lambda ids: tok.decode(ids)), f"decoded by {path}"
        except DataError:
            pass
    return (lambda ids: " ".join(map(str, ids))), "token ids: the folder's tokenizer is not available here"


def render_row(ids: list[int], targets: list[bool], decode) -> str:
    """A row's text with each run of target tokens (those that carry loss) inside ``[[ ]]``; ``repr``-escaped so
    that line breaks of the text stay visible and the row stays one line."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and targets[j] == targets[i]:
            j += 1
        text = json.dumps(decode(ids[i:j]), ensure_ascii=False)[1:-1]
        out.append(f"{TRAINED[0]}{text}{TRAINED[1]}" if targets[i] else text)
        i = j
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m moeshard.data``; a failure prints one line (``moeshard.data: error: ...``) on stderr.

    Returns:
        an :class:`ExitStatus`: 0; 2 for a bad input or flag (``DataError``); 1 for anything unexpected
        (``MOESHARD_TRACEBACK=1`` adds the traceback); 130 on Ctrl-C.
    """
    try:
        args = build_parser().parse_args(argv)
        if args.command == "prepare":
            _prepare(args)
        else:
            _inspect(args)
    except DataError as e:
        print_error(PROG, str(e))
        return ExitStatus.USER_ERROR
    except KeyboardInterrupt:
        print_error(PROG, "interrupted (prepare resumes where it stopped when run again with the same flags)")
        return ExitStatus.INTERRUPTED
    except Exception as e:  # noqa: BLE001 - a bug or a crash: one line too, the traceback on request
        first = (str(e).splitlines() or [""])[0]
        print_error(PROG, f"{type(e).__name__}: {first} (unexpected; MOESHARD_TRACEBACK=1 shows the traceback)")
        if os.environ.get("MOESHARD_TRACEBACK") == "1":
            traceback.print_exc()
        return ExitStatus.FAILED
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
