"""Throughput arithmetic and the loop's measuring callbacks: step timer, metrics.jsonl + TensorBoard, progress bar.

MFU convention (stated so figures can be compared):
FLOPs/token = 6 · (matmul parameters active per token) + 6 · L · 2 · (S/2) · (heads · head_dim)   (causal attention)
MFU = tokens/s/GPU · FLOPs/token / 989e12   (H200 bf16 dense datasheet peak).
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from moeshard.train.train import Callback, Job, StepStats

H200_BF16_PEAK_FLOPS = 989e12


def matmul_params_per_token(config: Any) -> int:
    """Matmul parameters one token passes through (embedding lookup excluded, LM head included)."""
    d, hd = config.hidden_size, config.head_dim
    attn = d * config.num_attention_heads * hd * 2 + d * config.num_key_value_heads * hd * 2
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_layers = set(getattr(config, "mlp_only_layers", None) or [])
    total = 0
    for layer in range(config.num_hidden_layers):
        moe = layer not in dense_layers and config.num_experts > 0 and (layer + 1) % sparse_step == 0
        if moe:
            mlp = config.num_experts_per_tok * 3 * d * config.moe_intermediate_size + d * config.num_experts
        else:
            mlp = 3 * d * config.intermediate_size
        total += attn + mlp
    return total + d * config.vocab_size


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) with causal attention, see the module docstring."""
    attn = 6 * config.num_hidden_layers * 2 * (seq_len / 2) * config.num_attention_heads * config.head_dim
    return 6 * matmul_params_per_token(config) + attn


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
        from tqdm import tqdm

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

    A record holds the step's ``loss``, ``aux_loss``, ``grad_norm`` (before clipping), ``lr`` (the one it used),
    throughput from ``step_time_s`` (a :class:`StepTimer` earlier in the callback list), MFU, peak memory, and
    whatever else earlier callbacks put into ``stats.extra`` (``comm``, ``tokens_seen``).
    """

    def __init__(
        self,
        job: Job,
        output_dir: Path,
        *,
        enabled: bool,
        start_step: int = 0,
        console: Callable[[str], None] | None = None,
    ) -> None:
        cfg = job.cfg
        self.job, self.enabled, self.start_step = job, enabled, start_step
        self.console = console or functools.partial(print, flush=True)
        self.path = output_dir / "metrics.jsonl"
        self.tensorboard_dir = output_dir / "tensorboard" if cfg.logging.tensorboard else None
        self.tokens_per_rank = cfg.train.global_batch_size * cfg.data.seq_len / job.meshes.world_size
        self.flops_per_token = flops_per_token(job.model_config, cfg.data.seq_len)
        self.writer = None
        self._counts: torch.Tensor | None = None
        self._hook = None

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
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events an interrupted attempt wrote after the checkpoint we resume from.
            self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=self.start_step + 1)

    def on_step_start(self, step: int) -> None:
        every = self.job.cfg.logging.expert_load_every
        if self.writer is not None and every and step % every == 0:
            self._counts = None
            self._hook = self.job.model.register_forward_hook(self._count_experts)

    def _count_experts(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if output.router_logits is not None:
            counts = expert_counts(output.router_logits, self.job.model_config)
            self._counts = counts if self._counts is None else self._counts + counts

    def before_update(self, step: int, stats: StepStats) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_step_end(self, step: int, stats: StepStats) -> None:
        cfg = self.job.cfg
        if self.enabled and (step % cfg.logging.every_steps == 0 or step == cfg.train.steps):
            loss, aux_loss, grad_norm = stats.read()
            dt = stats.extra["step_time_s"]
            tps = self.tokens_per_rank / dt
            record = {
                "step": step,
                "loss": loss,
                "aux_loss": aux_loss,
                "grad_norm": grad_norm,
                "lr": stats.lr,
                "tokens_per_s_per_gpu": tps,
                "mfu": mfu(tps, self.flops_per_token),
                "max_memory_gib": max_memory_gib(self.job.device),
                **stats.extra,
            }
            self.log(record)
        if self._counts is not None:
            self.expert_load(step, self._counts)
            self._counts = None

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (``step`` included) to metrics.jsonl, TensorBoard and the console."""
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.writer is not None:
            for k, v in _flatten(record).items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, step)
        self.console(
            f"step {step:>6d} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f} | "
            f"gnorm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s_per_gpu']:.0f} tok/s/gpu | mfu {100 * record['mfu']:.1f}% | "
            f"mem {record['max_memory_gib']:.2f} GiB"
        )

    def expert_load(self, step: int, counts_LE: torch.Tensor) -> None:
        """Per-layer expert load (tokens per expert): max/mean ratio scalars and a layers × experts heatmap."""
        if self.writer is None:
            return
        counts = counts_LE.double()
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        for layer, r in enumerate(ratio.tolist()):
            self.writer.add_scalar(f"expert_load/max_over_mean/layer_{layer}", r, step)
        heat = counts / counts.max(dim=1, keepdim=True).values.clamp_min(1e-9)
        img = (heat * 255).to(torch.uint8)[None]  # 1 x L x E grayscale
        self.writer.add_image("expert_load/heatmap", img, step, dataformats="CHW")

    def on_run_end(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self.writer is not None:
            self.writer.close()


def expert_counts(router_logits: Sequence[torch.Tensor], config: Any) -> torch.Tensor:
    """Tokens per expert of each MoE layer (``[layers, experts]``, CPU) from the router logits of a forward."""
    k = config.num_experts_per_tok
    per_layer = [
        torch.bincount(lg.topk(k, dim=-1).indices.flatten(), minlength=config.num_experts) for lg in router_logits
    ]
    return torch.stack(per_layer).cpu()
