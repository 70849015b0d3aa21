"""Throughput arithmetic and the rank-0 metrics sinks: metrics.jsonl, TensorBoard, progress line.

MFU convention (stated so figures can be compared):
FLOPs/token = 6 · (matmul parameters active per token) + 6 · L · 2 · (S/2) · (heads · head_dim)   (causal attention)
MFU = tokens/s/GPU · FLOPs/token / 989e12   (H200 bf16 dense datasheet peak).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

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


class MetricsSink:
    """Rank-0 writer of ``metrics.jsonl`` and TensorBoard scalars/images; a no-op elsewhere."""

    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        tensorboard: bool,
        total_steps: int,
        progress: bool,
        start_step: int = 0,
    ):
        """Open the sinks; a run that (re)starts at ``start_step`` first drops the records of later steps that an
        interrupted attempt had written, so every step appears once."""
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        self.bar = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [
                ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= start_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the events an interrupted attempt wrote after the checkpoint we resume from.
            self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"), purge_step=start_step + 1)
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (``step`` included) to metrics.jsonl, TensorBoard and the console."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.writer is not None:
            for k, v in _flatten(record).items():
                if k != "step" and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, step)
        line = (
            f"step {step:>6d} | loss {record['loss']:.4f} | aux {record['aux_loss']:.4f} | "
            f"gnorm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s_per_gpu']:.0f} tok/s/gpu | mfu {100 * record['mfu']:.1f}% | "
            f"mem {record['max_memory_gib']:.2f} GiB"
        )
        self.write(line)

    def write(self, line: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, steps: int = 1) -> None:
        """Move the progress bar."""
        if self.bar is not None:
            self.bar.update(steps)

    def expert_load(self, step: int, counts_LE: torch.Tensor) -> None:
        """Per-layer expert load (tokens per expert): max/mean ratio scalars and a layers × experts heatmap."""
        if not self.enabled or self.writer is None:
            return
        counts = counts_LE.double()
        ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        for layer, r in enumerate(ratio.tolist()):
            self.writer.add_scalar(f"expert_load/max_over_mean/layer_{layer}", r, step)
        heat = counts / counts.max(dim=1, keepdim=True).values.clamp_min(1e-9)
        img = (heat * 255).to(torch.uint8)[None]  # 1 x L x E grayscale
        self.writer.add_image("expert_load/heatmap", img, step, dataformats="CHW")

    def close(self) -> None:
        """Flush everything."""
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
