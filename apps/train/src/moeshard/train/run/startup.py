"""The job's start-up block: what it trains, on what layout, from which data, and where its outputs go, printed once
by rank 0 before the first step (a user need not check by hand that ``model.path`` was read).

    model       qwen3_moe from /data/Qwen3-30B-A3B (model_type qwen3_moe)
    parameters  30.5B total, 3.4B active per token; compute dtype bfloat16 (auto)
    layout      world 16 = 2 nodes x 8 GPUs; ep 8, ep_fsdp 2; 16 data-parallel ranks
    batch       micro-batch 1 x 2 accumulation x 16 ranks = 32 rows of 4096 = 131,072 tokens per step, 1000 steps
    lora        rank 16, alpha/r = 2; modules: all-linear; parameters: - (192 linear modules, 0 expert tensors); 13.4M trained, the base frozen

Under sequence parallelism (``parallel.sp_size`` > 1) the layout counts data-parallel groups of ``sp`` ranks (each
row split over one group) and the batch's accumulation is per group.
    data        web: weight 0.800, 1,234,567,890 tokens, 2,345,678 documents, /data/web-prepared
    outputs     outputs/run (checkpoints outputs/run/checkpoints; Hub folders outputs/run/hf: final)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from moeshard.train.families import family_of

if TYPE_CHECKING:
    import torch

    from moeshard.data import Dataset
    from moeshard.lora import LoraAdapters
    from moeshard.meshes import ParallelMeshes
    from moeshard.train.config import JobConfig


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _source_path(path: str | tuple[str, ...]) -> str:
    return path if isinstance(path, str) else ", ".join(path)


def startup_block(
    cfg: JobConfig,
    model_config: object,
    meshes: ParallelMeshes,
    ranks_per_node: int,
    data: Dataset,
    device: torch.device,
    ckpt_dir: Path,
    adapters: LoraAdapters | None = None,
) -> str:
    """The block's lines (label, then text), aligned; parameter counts come from the family
    (``ModelFamily.count_parameters``), a LoRA job's line from its ``adapters``."""
    family = family_of(model_config)
    m = cfg.model
    if m.path is not None:
        source = f"from {Path(m.path).resolve()} (model_type {getattr(model_config, 'model_type', None)})"
    else:
        source = f"preset {m.preset}"
    if m.overrides:
        source += ", overrides " + ", ".join(f"{k}={v}" for k, v in m.overrides.items())
    total, active = family.count_parameters(model_config)
    dtype = cfg.parallel.param_dtype
    if dtype == "auto":  # ParallelOptions' rule: bfloat16 on CUDA, float32 elsewhere
        dtype = f"{'bfloat16' if device.type == 'cuda' else 'float32'} (auto)"

    world, ep, ep_fsdp = meshes.world_size, meshes.ep_size, meshes.ep_fsdp_size
    nodes = world // ranks_per_node
    gpus = "GPU" if device.type == "cuda" else "rank"
    t = cfg.train
    sp = cfg.parallel.sp_size
    dp = world // sp  # data-parallel ranks, or groups of sp ranks that share each row
    accumulation = t.global_batch_size // (dp * t.micro_batch_size)
    seq = cfg.data.seq_len
    if sp > 1:
        data_parallel = f"sp {sp}: {dp} data-parallel group{'s' * (dp != 1)} of {sp} ranks, each row split over one"
        per = f"group{'s' * (dp != 1)}"
    else:
        data_parallel, per = f"{world} data-parallel rank{'s' * (world != 1)}", f"rank{'s' * (world != 1)}"

    lines = [
        ("model", f"{family.name} {source}"),
        ("parameters", f"{_count(total)} total, {_count(active)} active per token; compute dtype {dtype}"),
        (
            "layout",
            f"world {world} = {nodes} node{'s' * (nodes != 1)} x {ranks_per_node} {gpus}{'s' * (ranks_per_node != 1)}; "
            f"ep {ep}, ep_fsdp {ep_fsdp}; {data_parallel}",
        ),
        (
            "batch",
            f"micro-batch {t.micro_batch_size} x {accumulation} accumulation x {dp} {per} = "
            f"{t.global_batch_size} rows of {seq} = {t.global_batch_size * seq:,} tokens per step, {t.steps} steps",
        ),
    ]
    if adapters is not None:  # the adapters' full shapes: every rank's share together
        trained = sum(math.prod(shape) for shape in adapters.shapes.values())
        lines.append(
            ("lora", f"{adapters.describe().removeprefix('lora: ')}; {_count(trained)} trained, the base frozen")
        )
    summary = data.summary()
    sources = cfg.data.source_list()
    if not sources:
        s = next(iter(summary.values()))
        lines.append(("data", f"synthetic: {s['tokens']:,} tokens, {s['rows']:,} rows"))
    for src, (name, s) in zip(sources, summary.items()):
        # Prepared folders: the count of their headers; raw files: tokenised at start-up, so counted too.
        lines.append(
            ("data", f"{name}: weight {s['weight']:.3f}, {s['tokens']:,} tokens, {s['documents']:,} documents, "
             f"{_source_path(src.path)}")
        )  # fmt: skip
    out = Path(cfg.logging.output_dir)
    c = cfg.checkpoint
    hub = f"; Hub folders {out / 'hf'}: {c.save_hf}" if c.save_hf != "none" else ""
    lines.append(("outputs", f"{out} (checkpoints {ckpt_dir}{hub})"))
    width = max(len(label) for label, _ in lines) + 2
    return "\n".join(f"{label:<{width}}{text}" for label, text in lines)
