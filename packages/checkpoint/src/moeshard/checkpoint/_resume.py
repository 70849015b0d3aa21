"""Before a resume: which checkpoint, is it intact, and loading it (DCP state, the small files).

:func:`validate_checkpoint` checks the files ``COMPLETE`` records, ``.metadata`` (readable, and every shard file it
names present and long enough) and the shared small file; :func:`find_resume` with ``auto`` skips a damaged
checkpoint for the newest one that validates; :func:`set_aside` renames a damaged one to ``step_XXXXXXXX.damaged``.
The small files are JSON or tensors loaded with ``weights_only=True``: nothing in them can run code (DCP's
``.metadata`` is a pickle: load only your own checkpoints).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moeshard.checkpoint._checkpoint import (
    COMPLETE,
    EXTRA_JSON,
    EXTRA_LEGACY,
    complete_checkpoints,
    describe_failure,
    read_marker,
)
from moeshard.checkpoint._errors import CheckpointError


def validate_checkpoint(path: Path) -> None:
    """Check a complete checkpoint's files before loading it.

    ``COMPLETE`` is readable and every file it records is there with the recorded size (checkpoints written
    before that record have none); ``.metadata`` is readable and every shard file it names is there and long
    enough for the ranges it reads; ``extra.json`` (or an older checkpoint's ``extra.pt``) is there.

    Raises:
        ValueError: one line, ``checkpoint <path> is damaged: <file> ...``, naming the first damaged file (or
            that the folder is not a complete checkpoint of this package).
    """
    from torch.distributed.checkpoint import FileSystemReader

    def damaged(what: str) -> ValueError:
        return ValueError(f"checkpoint {path} is damaged: {what}")

    if not (path / COMPLETE).is_file():
        read_marker(path)  # raises: not complete
    try:
        marker = json.loads((path / COMPLETE).read_text())
        recorded = dict(marker.get("files") or {})
    except (ValueError, OSError, AttributeError, TypeError) as e:
        raise damaged(f"{COMPLETE} is unreadable ({type(e).__name__}: {e})") from None
    for name, size in sorted(recorded.items()):
        f = path / name
        if not f.is_file():
            raise damaged(f"{name} is missing ({COMPLETE} records it)")
        if f.stat().st_size != size:
            raise damaged(f"{name} has {f.stat().st_size} bytes, {COMPLETE} recorded {size}")
    if not (path / ".metadata").is_file():
        raise damaged(".metadata is missing")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - a pickle of any damage raises anything
        raise damaged(f".metadata is unreadable ({type(e).__name__}: {str(e)[:120]})") from None
    for name, end in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            raise damaged(f"{name} is missing (.metadata names it)")
        if f.stat().st_size < end:
            raise damaged(f"{name} has {f.stat().st_size} bytes, .metadata reads up to byte {end}")
    extra_file(path)  # raises: not one of ours


def extra_file(path: Path) -> Path:
    """The checkpoint's shared small file: ``extra.json``, or ``extra.pt`` in older checkpoints.

    Raises:
        ValueError: neither is there (not a checkpoint of this package).
    """
    for name in (EXTRA_JSON, EXTRA_LEGACY):
        if (path / name).is_file():
            return path / name
    raise ValueError(
        f"{path} has no {EXTRA_JSON}: it is not a moeshard-train checkpoint; point checkpoint.resume elsewhere"
    )


def read_extra(path: Path) -> dict[str, Any]:
    """The small state rank 0 saved with the checkpoint (``extra`` of :func:`save_checkpoint`): JSON, or an older
    checkpoint's ``extra.pt`` loaded with ``weights_only=True`` (never an arbitrary pickle).

    Raises:
        ValueError: no such file, or it is unreadable (naming it).
    """
    f = extra_file(path)
    try:
        if f.name == EXTRA_JSON:
            return json.loads(f.read_text())
        return load_tensors(f)
    except Exception as e:  # noqa: BLE001 - a damaged file raises anything
        raise ValueError(f"checkpoint {path} is damaged: {f.name} is unreadable ({describe_failure(e)})") from None


def load_tensors(f: Path) -> Any:
    """``torch.load(f, weights_only=True)`` (tensors and plain values only: nothing in the file can run code); a
    refusal is one ``UnpicklingError`` line naming what it met, without torch's advice to retry unsafely."""
    try:
        return torch.load(f, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "WeightsUnpickler error:" in text:
            text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
        raise pickle.UnpicklingError("weights_only refused it: " + " ".join(text.split())) from None


def find_resume(resume: str, ckpt_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint ``checkpoint.resume`` (``auto``, ``none`` or a folder) names, validated before any load.

    Returns:
        ``(checkpoint or None, [(damaged checkpoint, why), ...])``: with ``auto`` the newest complete checkpoint
        that validates, and the newer ones skipped as damaged (left in place: :func:`set_aside` is the caller's).

    Raises:
        ValueError: an explicit folder that is missing, incomplete or damaged; ``auto`` when every complete
            checkpoint is damaged (starting over would hide them).
    """
    if resume == "none":
        return None, []
    if resume != "auto":
        path = Path(resume)
        if not path.is_dir():
            raise ValueError(f"checkpoint.resume {path} does not exist; use auto, none or a checkpoint folder")
        try:
            validate_checkpoint(path)
        except ValueError as e:
            raise ValueError(f"{e}; resume another checkpoint (auto: the newest that validates)") from None
        return path, []
    damaged: list[tuple[Path, str]] = []
    for path in reversed(complete_checkpoints(ckpt_dir)):
        try:
            validate_checkpoint(path)
        except ValueError as e:
            damaged.append((path, str(e)))
            continue
        return path, damaged
    if damaged:
        raise ValueError(
            f"every checkpoint in {ckpt_dir} is damaged (the newest: {damaged[0][1].split(': ', 1)[1]}); nothing "
            "was changed. Restore or move them away to start over, or point checkpoint.resume at a good copy"
        )
    return None, []


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``<name>.damaged`` (kept, never deleted): resume, pruning and a later save of
    the same step no longer see it. Returns the new path."""
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged{n}")
    os.rename(path, target)
    return target


def load_checkpoint(path: Path, app_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Load DCP state in place (any layout; every rank calls it); returns ``(extra, this rank's rank_state, or
    None when the checkpoint was written by another world size or has no file for this rank)``.

    Raises:
        CheckpointError: DCP could not load it (every rank alike), or a small file is unreadable (``extra`` on
            every rank alike; this rank's own file: ``every_rank=False``).
    """
    marker = read_marker(path)
    extra_file(path)  # raises: not one of ours
    advice = "its files may be damaged: resume an older checkpoint with checkpoint.resume=<folder>"
    try:
        dcp.load(app_state, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException; DCP raises it on every rank with every rank's failure
        raise CheckpointError(f"checkpoint {path} could not be loaded ({describe_failure(e)}); {advice}") from e
    try:
        extra = read_extra(path)
    except ValueError as e:
        raise CheckpointError(f"{e}; {advice}") from e
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    same_world = marker.get("world_size") == dist.get_world_size()  # else the per-rank files do not map
    try:
        rank_state = load_tensors(rank_file) if same_world and rank_file.is_file() else None
    except Exception as e:  # noqa: BLE001 - this rank's file only: the other ranks may not fail
        msg = f"checkpoint {path}: {rank_file.name} is unreadable ({describe_failure(e)}); {advice}"
        raise CheckpointError(msg, every_rank=False) from e
    return extra, rank_state
