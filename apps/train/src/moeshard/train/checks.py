"""Before a run: every check that needs no process group, on every rank alike, before anything is written.

The layout, batch sizes, the model config, the output directory, the checkpoint to resume and the data are checked
first; such problems raise :class:`~moeshard.train.errors.JobError` (rank 0 prints it as one line). With
``checkpoint.resume: auto`` (also after ``torchrun --max-restarts`` restarts the job) the newest complete
checkpoint is resumed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeshard.models.qwen3moe import STRUCTURAL_CONFIG_KEYS
from moeshard.train import checkpoint as ckpt
from moeshard.train.config import JobConfig, resolve_model_config
from moeshard.train.data import GlobalBatches, TokenDataset, build_dataset, check_batch_sizes
from moeshard.train.errors import JobError
from moeshard.train.train import check_model_fits


def print0(*args: Any) -> None:
    """Print on rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def run_identity(cfg: JobConfig) -> dict[str, Any]:
    """What makes two runs "the same run": model, data and optimisation (steps, layout, logging and
    checkpointing may change between a run and its resumption)."""
    d = cfg.to_dict()
    train = {k: v for k, v in d["train"].items() if k != "steps"}
    return {"model": d["model"], "data": d["data"], "train": train}


def guard_output_dir(cfg: JobConfig, output_dir: Path, resuming: bool) -> None:
    """Refuse an output_dir that holds a different run, or the same run without resuming it.

    Raises:
        JobError: naming the differing keys and the way out; nothing has been written.
    """
    run_file = output_dir / "run.json"
    if not run_file.is_file():
        if (output_dir / "metrics.jsonl").exists():
            raise JobError(
                f"logging.output_dir {output_dir} holds metrics.jsonl but no run.json (not a moeshard-train run); "
                "nothing was overwritten. Choose another logging.output_dir"
            )
        return
    previous = json.loads(run_file.read_text())
    ident = run_identity(cfg)
    if previous != ident:
        diff = [
            f"{s}.{k}"
            for s in ident
            for k in set(ident[s]) | set(previous.get(s, {}))
            if ident[s].get(k) != previous.get(s, {}).get(k)
        ]
        raise JobError(
            f"logging.output_dir {output_dir} holds a different run (differs in {', '.join(sorted(diff))}); "
            "nothing was overwritten. Choose another logging.output_dir, or restore that run's settings to resume it"
        )
    if not resuming:
        raise JobError(
            f"logging.output_dir {output_dir} already holds this run and checkpoint.resume is 'none'; "
            "nothing was overwritten. Use checkpoint.resume=auto to continue it, or another logging.output_dir"
        )


@dataclass
class Prepared:
    """What the checks produced: the model config, the data, where to write and what to resume."""

    model_config: Any
    data: TokenDataset
    batches: GlobalBatches
    output_dir: Path
    ckpt_dir: Path
    resume_path: Path | None
    rank: int
    world_size: int
    ranks_per_node: int


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def prepare(cfg: JobConfig) -> Prepared:
    """Every check that needs no process group, on every rank alike, before anything is written.

    The world comes from torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` / ``RANK`` (a world of one without them).

    Raises:
        JobError: one message naming the problem and its fix.
    """
    from moeshard.meshes import plan_layout

    world = _env_int("WORLD_SIZE", 1)
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    rank = _env_int("RANK", 0)
    p = cfg.parallel
    try:
        try:
            plan_layout(world, per_node, p.ep_size, allow_cross_node_ep=p.allow_cross_node_ep)
        except ValueError as e:  # the package speaks of its argument; the user sets a config key
            msg = str(e).replace("pass allow_cross_node_ep=True", "set parallel.allow_cross_node_ep=true")
            raise ValueError(f"parallel.ep_size: {msg}") from None
        check_batch_sizes(cfg.train.global_batch_size, world, cfg.train.micro_batch_size)
        mcfg = resolve_model_config(cfg)
        check_model_fits(cfg, mcfg)
        output_dir = Path(cfg.logging.output_dir)
        ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else output_dir / "checkpoints"
        if _env_int("TORCHELASTIC_MAX_RESTARTS", 0) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            print0(
                "note: torchrun shares its rendezvous store with the workers; restarted workers may then fail to "
                "connect (torch 2.13, gloo). Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun to restart reliably"
            )
        resume = cfg.checkpoint.resume
        if resume == "none" and _env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0:
            print0("restarted by torchrun: continuing this run from its newest complete checkpoint")
            resume = "auto"
        resume_path = None
        if resume == "auto":
            resume_path = ckpt.newest_checkpoint(ckpt_dir)
        elif resume != "none":
            resume_path = Path(resume)
            if not resume_path.is_dir():
                raise ValueError(
                    f"checkpoint.resume {resume_path} does not exist; use auto, none or a checkpoint folder"
                )
            ckpt.read_marker(resume_path)
        if resume_path is not None:
            _check_same_model(resume_path, mcfg)
        guard_output_dir(cfg, output_dir, resuming=resume != "none")
        data = build_dataset(
            cfg.data,
            vocab_size=mcfg.vocab_size,
            eos_id=_first(mcfg.eos_token_id),
            pad_id=getattr(mcfg, "pad_token_id", None),
        )
        batches = GlobalBatches(
            len(data), cfg.train.global_batch_size, world, cfg.train.micro_batch_size, cfg.data.shuffle, cfg.data.seed
        )
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from e
    return Prepared(mcfg, data, batches, output_dir, ckpt_dir, resume_path, rank, world, per_node)


def _check_same_model(path: Path, mcfg: Any) -> None:
    extra_file = path / "extra.pt"
    if not extra_file.is_file():
        raise ValueError(
            f"{path} has no extra.pt: it is not a moeshard-train checkpoint; point checkpoint.resume elsewhere"
        )
    saved = torch.load(extra_file, weights_only=False).get("model_config") or {}
    diff = [k for k in STRUCTURAL_CONFIG_KEYS if k in saved and saved[k] != getattr(mcfg, k, None)]
    if diff:
        raise ValueError(
            f"checkpoint {path} holds another model (differs in {', '.join(diff)}); resume it with its own model "
            "settings, or start this model without checkpoint.resume"
        )


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (list, tuple)) else x
