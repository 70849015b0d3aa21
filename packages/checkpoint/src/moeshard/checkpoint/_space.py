"""Disk space known before it runs out: a save's size against the free space of its folder, agreed by every rank.

A checkpoint folder is one folder every rank writes into and reads from (a layout-independent resume reads any
rank's pieces), so the size that counts is every rank's bytes together, against the free space rank 0 sees.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeshard.checkpoint._errors import CheckpointSaveError
from moeshard.checkpoint._stage import state_bytes

METADATA_ALLOWANCE = 64 << 20  # .metadata, the small files, each file's headers: at most this per checkpoint


def metadata_allowance(state_bytes: int) -> int:
    """Bytes beside the tensors a checkpoint of ``state_bytes`` may take on disk (``.metadata``, the small files,
    each file's headers): 1 MiB + 1/16 of the tensors, at most :data:`METADATA_ALLOWANCE` (a tiny model's
    checkpoints are not counted at 64 MiB each)."""
    return min(METADATA_ALLOWANCE, (1 << 20) + state_bytes // 16)


def human(n: float) -> str:
    """``12.34 GiB`` / ``5.6 MiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(folder: Path) -> int:
    """Free bytes (for this user) on the filesystem of ``folder``, or of its nearest existing parent."""
    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def agree_sizes(folder: Path, state: dict[str, Any], group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(bytes of every rank's state together, free bytes in folder seen by rank 0)``, the same on every rank
    (one all-reduce)."""
    rank0 = dist.get_rank(group) == 0
    figures = torch.tensor([state_bytes(state), free_bytes(folder) if rank0 else 0], dtype=torch.int64)
    dist.all_reduce(figures, group=group)
    return int(figures[0]), int(figures[1])


def check_room_for_save(folder: Path, step: int, state: dict[str, Any], group: dist.ProcessGroup | None = None) -> int:
    """Before a save writes anything: refuse it when its folder has less free space than the checkpoint needs.

    Returns:
        The checkpoint's expected bytes (every rank together).

    Raises:
        CheckpointSaveError: on every rank alike, one line naming both figures and the fix.
    """
    need, free = agree_sizes(folder, state, group)
    if need + metadata_allowance(need) > free:
        raise CheckpointSaveError(
            f"no room for the checkpoint of step {step} in {folder}: it needs {human(need)}, the disk has "
            f"{human(free)} free; nothing was written. Free disk space, lower keep_last or save to a larger disk"
        )
    return need
