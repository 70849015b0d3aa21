"""``moeshard-train plan``: the job's layout on the fake backend, no GPU and no communication.

Prints the meshes and groups, one row per parameter (global shape, this rank's local shape and placement), the
estimated memory per rank and the estimated communication per step by kind and by link (intra/inter-node).

With ``lora`` the job is built as training builds it: ``moeshard.lora.apply_lora`` on the meta model (the base
frozen in the compute dtype) before ``parallelize``, so the adapters' elements, shards and FSDP units are the model's
own, not a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeshard.train.commands.plan_build import _build, _Built, _compute_bytes, _expert_grad_bytes, _memory_estimate
from moeshard.train.commands.plan_memory import GiB, MemoryEstimate, memory_lines
from moeshard.train.commands.plan_regimes import ContextFit, _context_fit, _exceeds
from moeshard.train.config import JobConfig, check_layout, gradient_sync, parallel_options
from moeshard.train.families import family_of
from moeshard.train.observe.comm import estimate_comm_bytes


@dataclass(frozen=True)
class PlanReport:
    """The dry run's findings: the printed text and the figures behind it."""

    text: str
    memory: MemoryEstimate
    comm: dict[tuple[str, str], float]  # (kind, "intra-node" | "inter-node") -> bytes per rank per step
    comm_bound: dict[tuple[str, str], float]  # the same with the all-to-all upper bound
    warning: str | None = None  # the estimate exceeds the GPU's memory: by how much, and what would fit
    context: ContextFit | None = None  # with a GPU's memory: the smallest sp in which the job's rows fit it


def plan(
    cfg: JobConfig,
    *,
    nnodes: int,
    nproc_per_node: int,
    rank: int = 0,
    micro_batch_size: int | None = None,
    table: bool = True,
    gpu_memory_gib: float | None = None,
) -> str:
    """Build the job on meta under the fake backend as ``rank`` and describe it (see :func:`plan_report`); without
    ``gpu_memory_gib``, the estimate is compared with the memory of this machine's GPU, if it has one."""
    gpu = ("--gpu-memory", gpu_memory_gib) if gpu_memory_gib is not None else detected_gpu_memory()
    return plan_report(
        cfg,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rank=rank,
        micro_batch_size=micro_batch_size,
        table=table,
        gpu_memory=gpu,
    ).text


def detected_gpu_memory() -> tuple[str, float] | None:
    """``(name, GiB)`` of this machine's first CUDA GPU, None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / GiB


def plan_report(
    cfg: JobConfig,
    *,
    nnodes: int,
    nproc_per_node: int,
    rank: int = 0,
    micro_batch_size: int | None = None,
    table: bool = True,
    gpu_memory: tuple[str, float] | None = None,
) -> PlanReport:
    """Build the job on meta under the fake backend as ``rank`` (through ``parallelize`` with the job's options):
    meshes, options, parameter rows (``table=False``: left out, ``plan --summary``), memory and communication.

    Compute precision: ``parallel.param_dtype`` float32 means fp32, anything else bf16 (the GPU default).

    Args:
        gpu_memory: ``(where it comes from, GiB)`` of the GPU to compare the estimate with; where the estimate
            exceeds it, the report warns and names the first regime that fits
            (:func:`~moeshard.train.commands.plan_regimes._fitting_regime`).

    Raises:
        ConfigError: the config does not fit the layout (:func:`moeshard.train.config.check_layout`, the checks
            training makes before its first step, in the same words).
    """
    world = nnodes * nproc_per_node
    checked = check_layout(cfg, world_size=world, ranks_per_node=nproc_per_node)
    mcfg = checked.model_config
    built = _build(cfg, mcfg, nnodes, nproc_per_node, rank, table)
    compute_bytes = _compute_bytes(cfg)
    mb = micro_batch_size or cfg.train.micro_batch_size
    est = _memory_estimate(cfg, mcfg, built, world, mb, built.options)
    lines = list(built.lines)
    if table:
        lines.append("")
    numel = f"{built.total_numel / 1e9:.3f} B in total, {built.local_numel / 1e6:.2f} M on rank {rank}"
    lines.append(f"parameters: {numel}")
    lines.append(flops_line(mcfg, cfg.data.seq_len))
    if built.adapters is not None:
        lines.append(_lora_line(built))
    lines += memory_lines(
        est, built.options, mb, cfg.data.seq_len, compute_bytes, _expert_grad_bytes(cfg), lora=cfg.lora.enabled
    )
    warning = context = None
    if gpu_memory is not None:
        context = _context_fit(cfg, mcfg, built, nnodes, nproc_per_node, mb, gpu_memory[1] * GiB)
    if gpu_memory is not None and est.total > gpu_memory[1] * GiB:
        warning = _exceeds(cfg, mcfg, built, est, nnodes, nproc_per_node, mb, gpu_memory, context)
        lines.append(warning)
    if context is not None:
        lines.append(context.line(gpu_memory[1], nnodes * nproc_per_node))
    lines.append("")
    adapters = built.units.adapter_numel if built.adapters is not None else None
    comm = comm_estimate(cfg, mcfg, world, nproc_per_node, compute_bytes, built.units.once_numel, adapters=adapters)
    bound = comm_estimate(
        cfg,
        mcfg,
        world,
        nproc_per_node,
        compute_bytes,
        built.units.once_numel,
        uniform_routing=False,
        adapters=adapters,
    )
    lines += comm_estimate_lines(comm, bound)
    return PlanReport("\n".join(lines), est, comm, bound, warning, context)


def flops_line(config: Any, seq_len: int) -> str:
    """The report's FLOPs line: training FLOPs per token at ``seq_len`` (what MFU divides by) and its three terms,
    ``ModelFacts.flops_per_token``'s: the matmuls, causal attention (full and windowed layers), recurrent mixers'
    state work (forward and backward: 3x the forward's)."""
    facts = family_of(config).facts(config)
    total = facts.flops_per_token(seq_len)
    matmul, recurrent = 6 * facts.matmul_parameters, 3 * facts.recurrent_flops
    attention = total - matmul - recurrent  # the terms that grow with the keys a query sees
    return (
        f"FLOPs per token: {total / 1e9:.3f} G at seq {seq_len} (training: matmuls {matmul / 1e9:.3f} G, causal "
        f"attention {attention / 1e9:.3f} G, recurrent state work {recurrent / 1e9:.3f} G)"
    )


def _lora_line(built: _Built) -> str:
    """The report's LoRA line: the options, the targets, the adapters' elements."""
    a = built.adapters
    assert a is not None
    return (
        f"{a.describe()}; adapter parameters: {built.trained_total / 1e6:.2f} M in total, "
        f"{built.trained_local / 1e6:.2f} M on this rank (the base frozen in the compute dtype)"
    )


def comm_estimate(
    cfg: JobConfig,
    mcfg: Any,
    world: int,
    per_node: int,
    elem: int,
    once_numel: int,
    *,
    uniform_routing: bool = True,
    adapters: tuple[int, int] | None = None,
) -> dict[tuple[str, str], float]:
    """Bytes per optimizer step per rank by ``(kind, link)`` for this job (see :mod:`moeshard.train.observe.comm`).

    ``adapters``: a LoRA job's trained elements (outside the experts, this EP rank's experts'): only their gradients
    are reduce-scattered."""
    reshard, expert_reshard = parallel_options(cfg).resharding(world)
    return estimate_comm_bytes(
        mcfg,
        world_size=world,
        ranks_per_node=per_node,
        ep_size=cfg.parallel.ep_size,
        # each token on one rank whatever sp; the rows split over world / sp data-parallel groups
        tokens_per_rank=cfg.train.global_batch_size * cfg.data.seq_len // world,
        micro_batches=max(
            1, cfg.train.global_batch_size // (world // cfg.parallel.sp_size) // cfg.train.micro_batch_size
        ),
        compute_bytes=elem,
        reshard_after_forward=reshard,
        once_numel=once_numel,
        expert_reshard_after_forward=expert_reshard,
        expert_reduce_bytes=_expert_grad_bytes(cfg),
        activation_checkpointing=parallel_options(cfg).activation_checkpointing == "full",
        reduce_every_micro_batch=gradient_sync(cfg.train, world) == "every_micro_batch",
        sp_size=cfg.parallel.sp_size,
        uniform_routing=uniform_routing,
        adapter_numel=adapters,
    )


def comm_estimate_lines(est: dict[tuple[str, str], float], bound: dict[tuple[str, str], float]) -> list[str]:
    """Bytes per optimizer step per rank by collective kind, and which of them cross nodes."""
    out = ["estimated communication per optimizer step per rank (bytes sent to peers; all-to-all for uniform routing):"]
    for (kind, link), b in sorted(est.items()):
        extra = f"   (at most {bound[(kind, link)] / 2**20:.1f} MiB)" if kind == "all_to_all" else ""
        out.append(f"  {kind:16s} {link:11s} {b / 2**20:12.1f} MiB{extra}")
    out.append("  all_reduce       (loss, token count, gradient norm: a few scalars per step)")
    return out
