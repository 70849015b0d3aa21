"""moeshard.checkpoint: atomic, validated, resumable checkpoints of a parallel job, saved in the background.

A checkpoint is a folder ``step_XXXXXXXX`` of ``torch.distributed.checkpoint`` (DCP) files, published only once
every rank wrote its part (``COMPLETE`` records each file and its size); resumes validate it and fall back to the
newest intact one; ``keep_last`` prunes older ones. The model and optimizer state is layout-independent
(``moeshard.fsdp_moe``'s EP-aware state dict): a checkpoint of one EP size / world size loads into any other.
Saves stage the state into host buffers allocated once (pinned, on a side CUDA stream) and write it with several
threads per rank, synchronously or in the background; the free space is checked before any write. One job per
output directory (:class:`OutputLock`); a hang ends the job within a timeout (:class:`HangWatchdog`).

    from moeshard.checkpoint import Stager, find_resume, load_model_state, model_state, save_checkpoint

    stager = Stager(device)                                    # buffers reused by every save of the job
    path, damaged = find_resume("auto", ckpt_dir)              # the newest checkpoint that validates
    if path is not None:
        extra, rank_state = load_model_state(path, model, optim)
    saved = save_checkpoint(ckpt_dir, step, model_state(model, optim), {"step": step}, {}, keep_last=2,
                            stager=stager)                     # saved.path, saved.write_s, saved.gb_per_s
"""

from moeshard.checkpoint._async import PendingSave, start_async_save
from moeshard.checkpoint._checkpoint import (
    Saved,
    SaveOptions,
    check_room_for_run,
    complete_checkpoints,
    describe_failure,
    newest_checkpoint,
    read_marker,
    save_checkpoint,
)
from moeshard.checkpoint._errors import CheckpointError, CheckpointSaveError
from moeshard.checkpoint._lock import OutputLock
from moeshard.checkpoint._resume import find_resume, load_checkpoint, read_extra, set_aside, validate_checkpoint
from moeshard.checkpoint._stage import Stager
from moeshard.checkpoint._state import load_model_state, model_state
from moeshard.checkpoint._watchdog import HangWatchdog

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "HangWatchdog",
    "OutputLock",
    "PendingSave",
    "SaveOptions",
    "Saved",
    "Stager",
    "check_room_for_run",
    "complete_checkpoints",
    "describe_failure",
    "find_resume",
    "load_checkpoint",
    "load_model_state",
    "model_state",
    "newest_checkpoint",
    "read_extra",
    "read_marker",
    "save_checkpoint",
    "set_aside",
    "start_async_save",
    "validate_checkpoint",
]
