"""Throughput arithmetic and the loop's measuring callbacks: step timer, metrics.jsonl + TensorBoard, progress bar.

Tokens are *predicted* tokens: labels other than -100 (padding, prompt tokens of SFT records and the first token of
each packed document piece predict nothing), summed over all ranks by the step's loss all-reduce.

MFU convention (stated so figures can be compared):
FLOPs/token = 6 · (matmul parameters active per token) + 6 · L · (S/2) · heads · (qk_head_dim + v_head_dim)   (causal
attention; the family's ``flops_per_token``: Qwen3-MoE's head_dim twice, DeepSeek-V3's MLA from its projections)
MFU = tokens/s/GPU · FLOPs/token / peak, the peak of the detected device (:data:`PEAK_BF16_FLOPS`: bf16 dense
datasheet figures); left out on CPU and on devices the table does not know.
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moeshard.train.families import family_of
from moeshard.train.run import Callback, Job, StepStats

H200_BF16_PEAK_FLOPS = 989e12

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),  # GH200 too
    ("B200", 2.25e15),
    ("A100", 312e12),
)
"""Dense bf16 peak FLOP/s by a part of the CUDA device name, first match wins (NVIDIA datasheets, SXM parts)."""


def device_peak_flops(device: torch.device) -> float | None:
    """The bf16 dense peak of ``device`` from :data:`PEAK_BF16_FLOPS`, or None (CPU, an unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in name), None)


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) with causal attention, by the model family's formula (see the
    module docstring; DeepSeek-V3 counts MLA from its real projections)."""
    return family_of(config).flops_per_token(config, seq_len)


def mfu(tokens_per_s_per_gpu: float, flops_token: float, peak: float = H200_BF16_PEAK_FLOPS) -> float:
    """Model FLOPs utilisation against ``peak`` (H200 bf16 datasheet by default)."""
    return tokens_per_s_per_gpu * flops_token / peak


def max_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or this process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


class StepTimer(Callback):
    """Puts ``step_time_s`` into each step's stats: host time between this step's read of its stats and the previous
    step's. The loop waits there for the step's backward (to check the loss before the update) but never for an
    optimizer step, so the host prepares the next step while the device updates.

    Args:
        restart_after: steps after which the clock restarts when the next step starts (a checkpoint's save time
            is no step's).
    """

    def __init__(self, restart_after: Callable[[int], bool] = lambda step: False) -> None:
        self.restart_after = restart_after
        self._last = 0.0

    def on_run_start(self) -> None:
        self._last = time.perf_counter()

    def on_step_start(self, step: int) -> None:
        if self.restart_after(step - 1):
            self._last = time.perf_counter()

    def before_update(self, step: int, stats: StepStats) -> None:
        stats.read()  # the step's one read (whoever asks first); the time is taken once it has returned
        now = time.perf_counter()
        stats.extra["step_time_s"], self._last = now - self._last, now


class TokensPerSource(Callback):
    """Puts ``tokens_seen`` into each step's stats: per data source, the tokens trained on up to and including the
    step (all ranks, padding excluded), so metrics.jsonl and TensorBoard (``tokens_seen/<source>``) show the mixture.

    Args:
        tokens_per_source: ``(start_step, stop_step) -> {source: tokens}`` of steps ``[start, stop)``, 0-based
            (``moeshard.data.StepBatches.tokens_per_source``: a pure function, so a resumed run continues the count).
        start_step: steps already taken.
    """

    def __init__(self, tokens_per_source: Callable[[int, int], dict[str, int]], start_step: int = 0) -> None:
        self.tokens_per_source = tokens_per_source
        self.seen = tokens_per_source(0, start_step)

    def on_step_end(self, step: int, stats: StepStats) -> None:
        for source, n in self.tokens_per_source(step - 1, step).items():  # step counts from 1
            self.seen[source] += n
        stats.extra["tokens_seen"] = dict(self.seen)


class ProgressBar(Callback):
    """A tqdm bar with ETA on stderr (rank 0); :meth:`write` prints a line without breaking it."""

    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
        )

    def write(self, line: str) -> None:
        """A console line above the bar."""
        self.bar.write(line)

    def on_step_end(self, step: int, stats: StepStats) -> None:
        self.bar.update(1)

    def on_run_end(self) -> None:
        self.bar.close()


class MetricsLogger(Callback):
    """Rank 0's ``metrics.jsonl``, TensorBoard scalars and console line every ``logging.every_steps`` steps (and the
    last), and the per-layer expert load every ``logging.expert_load_every`` steps; on other ranks it does nothing.

    A record holds the step's ``loss``, ``aux_loss`` (the balancing loss of ``train.aux_loss.scope``), ``z_loss``
    (with ``train.z_loss_coef``), ``grad_norm`` (before clipping), ``lr`` (the one it used), ``tokens_per_s_per_gpu``
    (predicted tokens, all ranks, per rank, over ``step_time_s`` of a :class:`StepTimer` earlier in the callback
    list), ``mfu`` (where the device's peak is known), peak memory, whatever else earlier callbacks put into
    ``stats.extra`` (``comm``, ``tokens_seen``), and every ``expert_load_every`` steps ``expert_load``:
    ``{"max_over_mean": {"layer_<l>": tokens of the layer's busiest expert / the mean over its experts}}``, from
    the step's counts over all ranks (TensorBoard: the same scalars and a layers x experts heatmap). Evaluation
    records (``val_loss``, ...) come through :meth:`log` too.
    """

    def __init__(
        self,
        job: Job,
        output_dir: Path,
        *,
        enabled: bool,
        start_step: int = 0,
        console: Callable[[str], None] | None = None,
        sinks: tuple[Any, ...] = (),
    ) -> None:
        cfg = job.cfg
        self.sinks = (
            sinks  # moeshard.train.observe.tracking's W&B / MLflow runs: every TensorBoard scalar, closed at the end
        )
        self.job, self.enabled, self.start_step = job, enabled, start_step
        self.console = console or functools.partial(print, flush=True)
        self.path = output_dir / "metrics.jsonl"
        self.tensorboard_dir = output_dir / "tensorboard" if cfg.logging.tensorboard else None
        self.world = job.meshes.world_size
        self.flops_per_token = flops_per_token(job.model_config, cfg.data.seq_len)
        self.peak = device_peak_flops(job.device)
        self.writer = None

    def on_run_start(self) -> None:
        """Open the sinks; a run that (re)starts at ``start_step`` first drops the records of later steps that an
        interrupted attempt had written, so every step appears once."""
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= self.start_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if self.tensorboard_dir is not None:
            # Imported here: tensorboard (protobuf) costs every command ~0.5 s of start-up, `--help` included.
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events an interrupted attempt wrote after the checkpoint we resume from.
            self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=self.start_step + 1)

    def on_step_end(self, step: int, stats: StepStats) -> None:
        cfg = self.job.cfg
        every = cfg.logging.expert_load_every
        load = stats.host_expert_load if every and step % every == 0 else None  # read with the step's figures
        if not self.enabled or not (step % cfg.logging.every_steps == 0 or step == cfg.train.steps or load is not None):
            return
        loss, aux_loss, grad_norm = stats.read()
        tps = stats.host_targets / self.world / stats.extra["step_time_s"]
        record = {"step": step, "loss": loss, "aux_loss": aux_loss}
        if stats.host_z_loss is not None:
            record["z_loss"] = stats.host_z_loss
        record.update(grad_norm=grad_norm, lr=stats.lr, tokens_per_s_per_gpu=tps)
        if self.peak is not None:
            record["mfu"] = mfu(tps, self.flops_per_token, self.peak)
        record.update(max_memory_gib=max_memory_gib(self.job.device), **stats.extra)
        if load is not None:
            record["expert_load"] = {"max_over_mean": dict(zip(_layer_names(load), load_imbalance(load).tolist()))}
        self.log(record)
        if load is not None and self.writer is not None:
            self.writer.add_image("expert_load/heatmap", load_heatmap(load), step, dataformats="CHW")

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (``step`` included) to metrics.jsonl, TensorBoard and the console: a training step's,
        or an evaluation's (``val_loss``, ``val_ppl``, ``val_tokens``)."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {k: v for k, v in _flatten(record).items() if k != "step" and isinstance(v, (int, float))}
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.log(scalars, step)
        self.console(console_line(record))

    def on_run_end(self) -> None:
        if self.writer is not None:
            self.writer.close()
        for sink in self.sinks:
            sink.close()


def console_line(record: dict[str, Any]) -> str:
    """The console line of a metrics record (a training step's or an evaluation's)."""
    step = record["step"]
    if "val_loss" in record:
        return (
            f"eval {step:>6d} | val_loss {record['val_loss']:.4f} | val_ppl {record['val_ppl']:.2f} | "
            f"{record['val_tokens']:,} tokens | {record.get('eval_time_s', 0.0):.1f} s"
        )
    z = f" | z {record['z_loss']:.4f}" if "z_loss" in record else ""
    util = f" | mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    imbalance = record.get("expert_load", {}).get("max_over_mean")
    load = f" | load max/mean {max(imbalance.values()):.2f}" if imbalance else ""
    return (
        f"step {step:>6d} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f}{z} | "
        f"gnorm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
        f"{record['tokens_per_s_per_gpu']:.0f} tok/s/gpu (predicted){util}{load} | "
        f"mem {record['max_memory_gib']:.2f} GiB"
    )


def load_imbalance(counts_LE: torch.Tensor) -> torch.Tensor:
    """Per layer: tokens of the busiest expert over the mean tokens per expert (1 is perfect balance; ``E / K`` for
    top-k routing that sends every token to the same experts)."""
    counts = counts_LE.double()
    return counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)


def load_heatmap(counts_LE: torch.Tensor) -> torch.Tensor:
    """A ``1 x layers x experts`` uint8 image of the counts, each layer scaled by its busiest expert."""
    counts = counts_LE.double()
    heat = counts / counts.max(dim=1, keepdim=True).values.clamp_min(1e-9)
    return (heat * 255).to(torch.uint8)[None]


def _layer_names(counts_LE: torch.Tensor) -> list[str]:
    return [f"layer_{layer}" for layer in range(counts_LE.shape[0])]


class RunTotals(Callback):
    """What the run's final summary line adds up: steps, predicted tokens (all ranks) and the steps' time
    (``step_time_s``: evaluations and checkpoint saves are not in it)."""

    def __init__(self) -> None:
        self.steps, self.tokens, self.step_time = 0, 0, 0.0
        self.started = time.perf_counter()

    def on_run_start(self) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, step: int, stats: StepStats) -> None:
        self.steps += 1
        self.tokens += stats.host_targets or 0
        self.step_time += stats.extra.get("step_time_s", 0.0)

    def tokens_per_s_per_gpu(self, world: int) -> float:
        """Mean predicted tokens per second per rank over the steps' time."""
        return self.tokens / world / self.step_time if self.step_time > 0 else 0.0
