"""The one error type of moeshard.data, and how its command line (and the application's) reports a failure."""

from __future__ import annotations

import enum
import sys


class DataError(ValueError):
    """Input the data layer cannot use: one line naming the file/record/key and the fix."""


class ExitStatus(enum.IntEnum):
    """Exit statuses of the command lines (``python -m moeshard.data`` and the applications built on it).

    ``USER_ERROR``: the input is wrong (a flag, a file, a config key); the one-line message says the fix and
    nothing was overwritten. ``FAILED``: something unexpected or at run time (a bug, a crash, a lost peer, a disk
    that filled up); running it again may succeed. ``INTERRUPTED``: Ctrl-C (SIGINT), as shells count it.
    """

    OK = 0
    FAILED = 1
    USER_ERROR = 2
    INTERRUPTED = 130


def print_error(prog: str, message: str, *, where: str = "") -> None:
    """The one line of a failure on stderr: ``PROG: error: MESSAGE`` (``where``, e.g. `` (rank 3)``, after
    ``error``); line breaks inside ``message`` become spaces, so a failure stays one line."""
    text = " ".join(message.split("\n"))
    print(f"{prog}: error{where}: {text}", file=sys.stderr, flush=True)
