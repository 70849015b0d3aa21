"""The training job in a checkpoint (``moeshard.checkpoint``): what it holds, how the loop saves and resumes it.

:func:`save_job` / :func:`resume_job` put a job (model, optimizers, scheduler, step, RNG) into and out of a
checkpoint folder; :class:`Checkpointer` is the loop's callback that saves every ``checkpoint.every_steps`` (in the
background with ``checkpoint.async``) and writes the Hub folders of ``checkpoint.save_hf``. The folder rules
(atomic publish, validation, pruning, free space) are the package's.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.tensor import DTensor

from moeshard.checkpoint import (
    PendingSave,
    Saved,
    Stager,
    check_room_for_run,
    describe_failure,
    load_checkpoint,
    load_model_state,
    model_state,
    newest_checkpoint,
    read_marker,
    save_checkpoint,
    start_async_save,
)
from moeshard.fsdp_moe import set_state_dict
from moeshard.lora import save_adapter
from moeshard.train.errors import JobError
from moeshard.train.export import export_adapter, export_hf, find_tokenizer
from moeshard.train.run import Callback, Job, StepStats, lr_at
from moeshard.train.run.build import base_model_name

OPTIMIZER_KEY = "optimizer"
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def app_state(job: Job) -> dict[str, Any]:
    """Model and optimizer state for DCP (layout independent, see ``moeshard.checkpoint.model_state``). A LoRA job's
    holds no frozen base parameter: its adapters, its buffers (what the run may change, e.g. routing biases) and
    the optimizer's state (the adapters')."""
    state = model_state(job.model, job.optimizer, masters="split")
    if job.adapters is not None:
        state["model"] = _without_frozen(job, state["model"])
    return state


def _without_frozen(job: Job, model_entries: dict[str, Any]) -> dict[str, Any]:
    # Parameter names as the state dict has them: without the wrappers' segments (checkpointing, compile).
    frozen = {_WRAPPERS.sub("", n) for n, p in job.model.named_parameters() if not p.requires_grad}
    return {k: v for k, v in model_entries.items() if k not in frozen}


def full_adapters(job: Job) -> dict[str, torch.Tensor]:
    """The LoRA adapters of the job, full (gathered over EP and FSDP), by their names in the model; every rank
    calls it (collectives), every rank gets them, on the CPU."""
    assert job.adapters is not None
    entries = model_state(job.model, job.optimizer)["model"]
    out = {}
    for name in job.adapters.names():
        t = entries[name]
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)
    return out


def write_adapter(job: Job, folder: Path) -> Path | None:
    """``<folder>`` in PEFT's format (``moeshard.lora.save_adapter``: ``adapter_config.json``,
    ``adapter_model.safetensors``, float32) from the job's adapters; every rank calls it, rank 0 writes. Returns
    the folder on rank 0, None elsewhere."""
    tensors = full_adapters(job)
    if dist.get_rank() != 0:
        return None
    model_class = type(job.model_config).__name__.replace("Config", "ForCausalLM")
    return save_adapter(folder, job.adapters, tensors, base_model=base_model_name(job.cfg), model_class=model_class)


def job_state(job: Job, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """What a checkpoint after ``step`` steps holds: ``(DCP state, extra, this rank's state)`` (model, optimizer;
    scheduler, step, config, data position as JSON; RNG states as tensors)."""
    config = job.cfg.to_dict()
    if config["data"].get("tokenizer"):  # absolute, as in run.json: an export from another folder still finds it
        config["data"]["tokenizer"] = os.path.abspath(os.path.expanduser(config["data"]["tokenizer"]))
    extra = {
        "step": step,
        "scheduler": {k: v for k, v in job.scheduler.state_dict().items() if k != "lr_lambdas"},
        "world_size": dist.get_world_size(),
        "config": config,
        "model_config": job.model_config.to_dict(),
        # What an export puts beside the weights, found now: the job's relative paths mean something only here.
        "model_path": os.path.abspath(job.cfg.model.path) if job.cfg.model.path else None,
        "tokenizer": dict(zip(("path", "from"), find_tokenizer(job.cfg, job.cfg.model.path))),
        # The data order is a pure function of the step (moeshard.data.StepBatches), so the step is the position.
        "data": {"step": step, "samples_seen": step * job.cfg.train.global_batch_size},
    }
    rank_state = {"cpu_rng": torch.get_rng_state()}
    if job.device.type == "cuda":
        rank_state["cuda_rng"] = torch.cuda.get_rng_state(job.device)
    return app_state(job), extra, rank_state


def save_job(
    job: Job,
    ckpt_dir: Path,
    step: int,
    writer_factory: Callable[[Path, int], StorageWriter] | None = None,
    stager: Stager | None = None,
) -> Saved:
    """Save an atomic, layout-independent checkpoint after ``step`` steps (model, optimizer, scheduler, data
    position, RNG); returns what the save did (``.path``: its folder). ``writer_factory``: the DCP storage writers
    (fault injection; None: the package's); ``stager``: the job's (CUDA: pinned buffers reused across saves)."""
    keep = job.cfg.checkpoint.keep_last
    return save_checkpoint(
        ckpt_dir, step, *job_state(job, step), keep_last=keep, stager=stager, writer_factory=writer_factory
    )


def write_hub_folder(
    checkpoint: Path, hf_dir: Path, dtype: str, say: Callable[[str], None] | None = None, *, lora: bool = False
) -> Path:
    """``checkpoint.save_hf``: the Hub folder ``hf_dir/<checkpoint's name>`` written from a complete checkpoint by
    :func:`moeshard.train.export.export_hf` (streaming: host memory bounded by a shard; the tokenizer and
    generation config beside the weights), atomically (a temporary folder renamed; an earlier folder of the same
    step is replaced). ``say``: the export's lines on a missing tokenizer or generation config (``print``).
    A LoRA run's checkpoint gives ``<folder>/adapter/`` in PEFT's format (``export-hf --merge-lora`` merges it
    into the base later). Returns the folder."""
    final, tmp = hf_dir / checkpoint.name, hf_dir / f".tmp-{checkpoint.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    say = say or print
    if lora:
        export_adapter(checkpoint, tmp / "adapter")
    else:
        export_hf(checkpoint, tmp, dtype=dtype, say=lambda line: say(line.replace(str(tmp), str(final))))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final


def resume_job(job: Job, path: Path) -> int:
    """Load a checkpoint of any layout into the job; returns the step it was taken after. A LoRA job reads only
    what its checkpoints hold (:func:`app_state`); its base is the one ``build`` loaded."""
    if job.adapters is None:
        extra, rank_state = load_model_state(path, job.model, job.optimizer)
    else:
        state = model_state(job.model, job.optimizer)
        stored = {"model": _without_frozen(job, state["model"]), OPTIMIZER_KEY: state[OPTIMIZER_KEY]}
        _check_lora_checkpoint(path, stored["model"])
        extra, rank_state = load_checkpoint(path, stored)  # into the entries of `state` (the same tensors)
        set_state_dict(job.model, state, job.optimizer)
    step = int(extra["step"])
    # The schedule is a function of the step (the saved scheduler state has one entry per parameter group, and the
    # groups depend on the layout: experts outside FSDP have an optimizer of their own). train.steps may have
    # changed: the schedule of this run decides.
    job.scheduler.last_epoch = step
    lr = lr_at(step, job.cfg)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    if rank_state is not None:  # same world size: each rank continues its own random stream
        torch.set_rng_state(rank_state["cpu_rng"])
        if "cuda_rng" in rank_state and job.device.type == "cuda":
            torch.cuda.set_rng_state(rank_state["cuda_rng"], job.device)
    return step


def _check_lora_checkpoint(path: Path, wanted: dict[str, Any]) -> None:
    """One line where the checkpoint is not one of this LoRA job (another rank, targets, or a full run's)."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [k for k in wanted if f"model.{k}" not in stored]
    if missing:
        raise ValueError(
            f"checkpoint {path} holds no {missing[0]} ({len(missing)} entries of this job missing): it is not a "
            "checkpoint of this LoRA job (lora.rank and targets); resume it with its own lora settings, or start "
            "in a new logging.output_dir"
        )


class Checkpointer(Callback):
    """Saves the job after every ``checkpoint.every_steps`` steps, after the last one (``save_final``, or
    ``save_hf`` other than ``none``) and after a step the ranks agreed to stop at (``StepStats.stop_agreed``: a
    preemption).

    After the run's first step the free space is checked for ``keep_last`` + 1 checkpoints (one line, before any
    write, when short) and, on CUDA, the staging buffers are allocated (pinned host memory, reused by every save).
    ``checkpoint.async``: every save but the run's last runs in the background (``moeshard.checkpoint``'s
    ``start_async_save``). The loop goes on at once (on CUDA the copy to pinned host memory runs on a side stream
    during the next step's forward and backward; its optimizer step waits for the copy on the device, the host
    does not); rank 0 publishes the checkpoint (``COMPLETE``, rename) at the first step end after the write ended
    on every rank; the next save and the end of the run wait for it, and a failed write stops the job there
    (:class:`CheckpointSaveError`), never published. ``checkpoint.save_hf``: rank 0 writes the Hub folder
    ``<output_dir>/hf/step_XXXXXXXX`` (:func:`write_hub_folder`) from every published checkpoint (``every``) or
    from the last step's (``final``); the other ranks wait for it at their next collective.

    Args:
        console: where rank 0's lines go (the progress bar's ``write``); ``print`` by default.
        writer_factory: the saves' DCP storage writers (``run.faults.Faults.storage_writer``); None: the package's.
    """

    def __init__(
        self,
        job: Job,
        ckpt_dir: Path,
        console: Callable[[str], None] | None = None,
        writer_factory: Callable[[Path, int], StorageWriter] | None = None,
    ) -> None:
        self.job, self.ckpt_dir, self.writer_factory = job, ckpt_dir, writer_factory
        self.console = console or functools.partial(print, flush=True)
        self.last_saved = newest_checkpoint(ckpt_dir)
        self.pending: PendingSave | None = None
        self._group = None
        self._background: dict[int, bool] = {}  # step -> saved in the background
        self._said: set[str] = set()  # what the Hub folders lack, said once a run
        c = job.cfg.checkpoint
        self.stager = Stager(job.device)
        self._prepared = not (c.every_steps or c.save_final or c.save_hf != "none")
        if c.async_:
            # A background save's collectives run on a gloo group of their own (made by every rank, here): on the
            # training's group they would interleave with the steps'.
            self._group = dist.new_group(backend="gloo")

    def due(self, step: int) -> bool:
        """Whether the loop saves after ``step``."""
        c = self.job.cfg.checkpoint
        last = step == self.job.cfg.train.steps and (c.save_final or c.save_hf != "none")
        return bool(c.every_steps and step % c.every_steps == 0) or last

    def before_update(self, step: int, stats: StepStats) -> None:
        if self.pending is not None:
            self.pending.wait_staged()  # the optimizer step is about to change the state being copied

    def _prepare(self) -> None:
        """After the run's first step (every rank): room for ``keep_last`` + 1 checkpoints, one line now rather
        than at a save hours later; on CUDA the staging buffers. Not earlier: the optimizer's state exists only
        after its first step (torch's ``get_optimizer_state_dict`` would make it by a step of its own, and the
        steps after it would differ)."""
        state = app_state(self.job)
        check_room_for_run(self.ckpt_dir, state, self.job.cfg.checkpoint.keep_last)
        if self.job.device.type == "cuda":
            self.stager.allocate(state)
        self._prepared = True

    def on_step_end(self, step: int, stats: StepStats) -> None:
        if not self._prepared:
            self._prepare()
        save = self.due(step) or stats.stop_agreed  # the ranks stop after this step (preemption): save it
        last = step == self.job.cfg.train.steps or stats.stop_agreed
        if self.pending is not None and (save or last):  # every rank, at the same step
            pending, self.pending = self.pending, None
            announced = pending.published is not None  # rank 0 published it at an earlier step end
            saved = pending.wait()
            if not announced:
                self._published(saved)
        elif self.pending is not None and dist.get_rank() == 0 and self.pending.published is None:
            if self.pending.publish_if_done() is not None:
                self._published(self.pending.times())
        if not save:
            return
        if self._group is not None and not last:
            state = job_state(self.job, step)
            keep = self.job.cfg.checkpoint.keep_last
            self._background[step] = True
            self.pending = start_async_save(
                self.ckpt_dir, step, *state, keep_last=keep, group=self._group, stager=self.stager,
                writer_factory=self.writer_factory,
            )  # fmt: skip
        else:
            self._published(save_job(self.job, self.ckpt_dir, step, self.writer_factory, self.stager))

    def _published(self, saved: Saved) -> None:
        path, step = saved.path, saved.step
        self.last_saved = path
        c = self.job.cfg.checkpoint
        background = self._background.pop(step, False)
        if dist.get_rank() == 0:  # one line per saved checkpoint: step, size, seconds, this rank's write rate
            size = sum(read_marker(path).get("files", {}).values())
            size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
            rate = f"{saved.rate_text} per rank" if saved.write_s > 0 else "-"
            if background:
                took = (
                    f"{saved.blocking_s:.2f} s blocked; written in {saved.write_s:.1f} s at {rate}, in the background"
                )
            else:
                took = f"{saved.blocking_s:.1f} s; written at {rate}"
            self.console(f"checkpoint of step {step}: {path} ({size_text}, {took})")
        if dist.get_rank() == 0 and (
            c.save_hf == "every" or (c.save_hf == "final" and step == self.job.cfg.train.steps)
        ):
            try:
                hf_dir = Path(self.job.cfg.logging.output_dir) / "hf"
                lora = self.job.adapters is not None
                hub = write_hub_folder(path, hf_dir, c.hf_dtype, say=self._say_once, lora=lora)
            except (OSError, ValueError) as e:  # e.g. a full disk; rank 0 only: the others stop on losing it
                raise JobError(
                    f"writing the Hub folder of step {step} failed ({describe_failure(e)}); the checkpoint {path} is "
                    "complete: resume from it, or export it later with moeshard-train export-hf",
                    every_rank=False,
                ) from e
            what = f"adapter {hub / 'adapter'}" if lora else f"Hub folder {hub}"
            self.console(f"{what} written from checkpoint {path.name} ({'float32' if lora else c.hf_dtype})")

    def _say_once(self, line: str) -> None:
        """An export's line on what a Hub folder lacks (``<folder>: no tokenizer: ...``): the first folder's only,
        not one per save."""
        what = line.split(": ", 1)[-1]
        if what not in self._said:
            self._said.add(what)
            self.console(line)

    def on_run_end(self) -> None:
        """After an error in the loop (a run that ends well waited at its last step): a background save still
        ends (each rank waits for its own write, no collective), rank 0 publishes it if it succeeded. The staging
        buffers are freed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.abandon()
        self.stager.release()
