"""Before a run: every check that needs no process group, on every rank alike, before anything is written.

The layout, batch sizes and the model config (:func:`moeshard.train.config.check_layout`, as ``plan`` and
``launch-local`` check them), the checkpoint to resume, the data (opened with ``moeshard.data``) and
the output directory are checked first; such problems raise :class:`~moeshard.train.errors.JobError` (rank 0
prints it as one line). With ``checkpoint.resume: auto`` (also after ``torchrun --max-restarts`` restarts the job)
the newest complete checkpoint is resumed. ``run.json`` in the output directory holds what identifies the run,
the data's content included (:func:`run_identity`): a resume on other data stops, unless ``data.allow_changed``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeshard import checkpoint as ckpt
from moeshard.data import Dataset, EvalBatches, StepBatches
from moeshard.lora import apply_lora, load_adapter
from moeshard.train.config import ConfigError, JobConfig, check_layout
from moeshard.train.errors import JobError
from moeshard.train.families import family_of
from moeshard.train.run.build import SCHEDULE_KEYS, base_model_name
from moeshard.train.run.data import build_data


def print0(*args: Any) -> None:
    """Print on rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)


def _absolute(path: Any) -> Any:
    if isinstance(path, list):
        return [_absolute(p) for p in path]
    return os.path.abspath(os.path.expanduser(path)) if isinstance(path, str) else path


def run_identity(cfg: JobConfig, data: Dataset) -> dict[str, Any]:
    """What makes two runs "the same run": model, data and optimisation (steps and the rest of the learning-rate
    schedule, ``moeshard.train.run.SCHEDULE_KEYS``, layout, evaluation, logging and checkpointing may change
    between a run and its resumption).

    The data are the ``data`` settings, with paths made absolute (for the record: what decides is the content), and
    ``data_content``: each source's weight, counts and content fingerprint (``moeshard.data.Dataset.summary``).
    """
    d = cfg.to_dict()
    train = {k: v for k, v in d["train"].items() if k not in SCHEDULE_KEYS}  # a resume may change the schedule
    settings = {k: v for k, v in d["data"].items() if k != "allow_changed"}  # a switch of the resume, not the run
    settings["path"], settings["tokenizer"] = _absolute(settings["path"]), _absolute(settings["tokenizer"])
    settings["sources"] = [{**s, "path": _absolute(s["path"])} for s in settings["sources"]]
    return {"model": d["model"], "data": settings, "train": train, "data_content": data.summary()}


def data_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the data of two run identities: settings other than paths (the same files named by
    another path, relative or absolute, are the same data), and each source's weight, counts and content."""

    def settings(ident: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in ident.get("data", {}).items() if k not in ("path", "tokenizer", "sources")}

    out = []
    old, new = settings(before), settings(now)
    out += [f"data.{k} {old.get(k)} -> {new.get(k)}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if "data_content" not in before:
        return [*out, "the run's run.json records no data content (written before moeshard-train 0.3)"]
    old, new = before["data_content"], now["data_content"]
    for name in [*old, *(n for n in new if n not in old)]:
        a, b = old.get(name), new.get(name)
        if b is None:
            out.append(f"source {name!r} is gone")
        elif a is None:
            out.append(f"source {name!r} is new ({b['documents']:,} documents, {b['tokens']:,} tokens)")
        else:
            if a["weight"] != b["weight"]:
                out.append(f"source {name!r} weight {a['weight']:.4g} -> {b['weight']:.4g}")
            if a["fingerprint"] != b["fingerprint"]:
                counts = (
                    f"{a['documents']:,} -> {b['documents']:,} documents, {a['tokens']:,} -> {b['tokens']:,} tokens"
                    if (a["documents"], a["tokens"]) != (b["documents"], b["tokens"])
                    else f"the same {b['documents']:,} documents and {b['tokens']:,} tokens"
                )
                out.append(f"source {name!r} holds other content ({counts})")
    return out


def guard_output_dir(cfg: JobConfig, output_dir: Path, resuming: bool, identity: dict[str, Any]) -> None:
    """Refuse an output_dir that holds a different run, or the same run without resuming it; a resume on changed
    data (``identity``'s settings or content) continues only with ``data.allow_changed``, and says what changed.

    Raises:
        JobError: naming the differing keys (or what changed in the data) and the way out; nothing has been written.
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
    old = {s: dict(previous.get(s, {})) for s in ("model", "train")}
    defaults = JobConfig().to_dict()
    diff = [
        f"{s}.{k}"
        for s in ("model", "train")
        for k in set(identity[s]) | set(old[s])
        if identity[s].get(k) != old[s].get(k)
        and not (s == "train" and k in SCHEDULE_KEYS)  # recorded by runs of earlier versions
        and not (k not in old[s] and identity[s].get(k) == defaults[s].get(k))  # a key added since
    ]
    changed = data_changes(previous, identity)
    if diff or (changed and not resuming):
        raise JobError(
            f"logging.output_dir {output_dir} holds a different run (differs in {'; '.join([*sorted(diff), *changed])}"
            "); nothing was overwritten. Choose another logging.output_dir, or restore that run's settings to resume it"
        )
    if changed:
        what = f"the data changed since the run in {output_dir} began: {'; '.join(changed)}"
        if not cfg.data.allow_changed:
            raise JobError(
                f"{what}; nothing was overwritten. Restore that data to resume exactly, or continue on this data "
                "deliberately with --data.allow_changed=true"
            )
        print0(f"warning: {what}; continuing on this data (data.allow_changed=true)")
    if not resuming:
        raise JobError(
            f"logging.output_dir {output_dir} already holds this run and checkpoint.resume is 'none'; "
            "nothing was overwritten. Use checkpoint.resume=auto to continue it, or another logging.output_dir"
        )


@dataclass
class Prepared:
    """What the checks produced: the model config, the data, the run's identity (for run.json), where to write
    and what to resume."""

    model_config: Any
    data: Dataset
    batches: StepBatches
    identity: dict[str, Any]
    output_dir: Path
    ckpt_dir: Path
    resume_path: Path | None
    rank: int
    world_size: int
    ranks_per_node: int
    damaged: list[tuple[Path, str]] = field(default_factory=list)  # newer checkpoints skipped: (folder, why)
    eval_batches: EvalBatches | None = None  # the held-out set (eval section), None without one


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def prepare(cfg: JobConfig) -> Prepared:
    """Every check that needs no process group, on every rank alike, before anything is written.

    The world comes from torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` / ``RANK`` (a world of one without them).

    Raises:
        ConfigError: the config does not fit the layout (:func:`moeshard.train.config.check_layout`).
        JobError: one message naming the problem and its fix.
    """
    world = _env_int("WORLD_SIZE", 1)
    per_node = _env_int("LOCAL_WORLD_SIZE", world)
    rank = _env_int("RANK", 0)
    p = cfg.parallel
    if "WORLD_SIZE" not in os.environ and p.ep_size > 1:  # started as a plain process, not by torchrun
        # The suggested world must also take the batch: the next multiple of ep_size x micro_batch_size.
        rows = p.ep_size * cfg.train.micro_batch_size
        gbs = cfg.train.global_batch_size
        batch = "" if gbs % rows == 0 else f" --train.global_batch_size={-(-gbs // rows) * rows}"
        raise ConfigError(
            f"parallel.ep_size {p.ep_size} needs at least {p.ep_size} processes and this job runs as one (started "
            f"without torchrun): run `torchrun --nproc-per-node {p.ep_size} -m moeshard.train ...{batch}` (or "
            f"`moeshard-train launch-local --nnodes 1 --nproc-per-node {p.ep_size} -- ...{batch}`), or set "
            "--parallel.ep_size=1"
        )
    # The checks plan and launch-local make too (ConfigError: reported as a config error, exit status 2).
    mcfg = check_layout(cfg, world_size=world, ranks_per_node=per_node).model_config
    try:
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
        resume_path, damaged = ckpt.find_resume(resume, ckpt_dir)  # validated: auto skips damaged checkpoints
        if resume_path is not None:
            _check_same_model(resume_path, mcfg)
        _check_tokenizer_folder(cfg.data.tokenizer)
        _check_lora(cfg, mcfg)
        # opened here: the run's identity needs it; rows are spread over the world/sp data-parallel groups
        data, batches, eval_batches = build_data(cfg, mcfg, world // cfg.parallel.sp_size)
        identity = run_identity(cfg, data)
        guard_output_dir(cfg, output_dir, resuming=resume != "none", identity=identity)
    except (ValueError, FileNotFoundError) as e:
        raise JobError(str(e)) from e
    return Prepared(
        mcfg, data, batches, identity, output_dir, ckpt_dir, resume_path, rank, world, per_node, damaged, eval_batches
    )


def _check_lora(cfg: JobConfig, mcfg: Any) -> None:
    """The ``lora`` section against the model, before anything is built: every target matches (on a model on the
    meta device), and ``init_from``'s folder has this job's rank, scaling, targets, base model and shapes.
    Raises ValueError with one line."""
    if not cfg.lora.enabled:
        return
    with torch.device("meta"):
        model = family_of(mcfg).model_class(mcfg)
    adapters = apply_lora(model, cfg.lora)
    if cfg.lora.init_from is not None:
        load_adapter(cfg.lora.init_from, adapters, base_model=base_model_name(cfg))


def _check_tokenizer_folder(tokenizer: str | None) -> None:
    """``data.tokenizer`` is a local folder, whatever the data (exports copy its files): a Hub id is never
    downloaded. Raises ValueError saying how to get it."""
    if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
        raise ValueError(
            f"data.tokenizer {tokenizer!r} is not a local folder (the job downloads nothing); give a local folder, or "
            f"download it first (e.g. `hf download {tokenizer if '/' in tokenizer else 'Qwen/Qwen3-30B-A3B'} "
            "--include 'tokenizer*' 'vocab.json' 'merges.txt' --local-dir DIR`) and pass DIR"
        )


def _check_same_model(path: Path, mcfg: Any) -> None:
    """Refuse a checkpoint of another model: every shape-deciding key (the family's ``structural_keys``: layers, widths,
    heads, experts, vocabulary) is compared under either of its names (the saved config stores ``num_experts`` as
    ``num_local_experts``); keys the saved config lacks are not compared."""
    saved = ckpt.read_extra(path).get("model_config") or {}  # ValueError: missing or unreadable, in one line
    aliases = {v: k for k, v in getattr(type(mcfg), "attribute_map", {}).items()}  # stored name -> alias
    aliases.update(getattr(type(mcfg), "attribute_map", {}))  # alias -> stored name
    diff = []
    for key in family_of(mcfg).structural_keys:
        name = key if key in saved else aliases.get(key)
        if name not in saved or saved[name] is None:
            continue
        now = getattr(mcfg, key, None)
        if saved[name] != (list(now) if isinstance(now, tuple) else now):
            diff.append(f"{key} {saved[name]} in the checkpoint, {now} now")
    if diff:
        raise ValueError(
            f"checkpoint {path} holds another model ({'; '.join(diff)}); resume it with its own model settings, or "
            "start this model in a new logging.output_dir with checkpoint.resume=none"
        )
