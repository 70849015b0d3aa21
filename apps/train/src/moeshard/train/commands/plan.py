"""``moeshard-train plan``: the job's layout on the fake backend, no GPU and no communication.

Prints the meshes and groups, one row per parameter (global shape, this rank's local shape and placement), the
estimated memory per rank and the estimated communication per step by kind and by link (intra/inter-node).

With ``lora`` the job is built as training builds it: ``moeshard.lora.apply_lora`` on the meta model (the base
frozen in the compute dtype) before ``parallelize``, so the adapters' elements, shards and FSDP units are the model's
own, not a formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from moeshard.ep import kept_factor_elements
from moeshard.fsdp_moe import expert_grad_budget, kept_factor_ratio
from moeshard.lora import LoraAdapters, apply_lora
from moeshard.meshes import build_meshes, fake_process_group
from moeshard.models.common import parallelize
from moeshard.train.commands.plan_memory import (
    GiB,
    MemoryEstimate,
    activation_bytes_per_token,
    adapter_activation_bytes_per_token,
    head_adds_in_backward,
    loss_head_bytes,
    loss_head_over_logits,
    memory_lines,
)
from moeshard.train.config import (
    ConfigError,
    JobConfig,
    check_layout,
    config_from_dict,
    gradient_sync,
    parallel_options,
)
from moeshard.train.families import family_of
from moeshard.train.observe.comm import estimate_comm_bytes
from moeshard.train.run.build import compute_dtype


def _kept_factor_ratio(config: Any, tokens: int, micro_batches: int, ep_size: int, dispatch: str) -> float:
    """What a step's kept weight-gradient factors hold over the local experts' gradients, per MoE layer: the EP
    dispatcher's report of one micro-batch's factors (``moeshard.ep.kept_factor_elements``, ``tokens · top_k``
    routed copies per rank) by ``moeshard.fsdp_moe.kept_factor_ratio`` against ``local experts · 3DF``."""
    facts = family_of(config).facts(config)  # the family's model says its shapes, whatever its config calls them
    d, k, f = facts.hidden_size, facts.top_k, facts.expert_width
    per_micro_batch = kept_factor_elements(dispatch, ep_size, tokens * k, d, f)
    return kept_factor_ratio(per_micro_batch, micro_batches, facts.num_experts // ep_size * 3 * d * f)


def _placement(p: Any, expert_meta: Any) -> str:
    parts = []
    if expert_meta is not None:
        parts.append(f"ep:Shard(0)x{expert_meta.ep_size}")
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ("?",)
        parts += [f"{n}:{pl}x{p.device_mesh.size(i)}" for i, (n, pl) in enumerate(zip(names, p.placements))]
    return " ".join(parts) or "replicated"


def _local(p: Any) -> torch.Size:
    return p.to_local().shape if isinstance(p, DTensor) else p.shape


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


class _Built(NamedTuple):
    """The job built on meta: what the memory estimate needs of it beyond the config."""

    lines: list[str]  # meshes, options and (with the table) the parameter rows
    options: Any  # the ParallelOptions the job was built with
    ep_size: int
    local_numel: int
    total_numel: int
    units: _UnitFigures
    trained_local: int  # elements on this rank that train (all of them without LoRA, the adapters with it)
    trained_total: int
    adapters: LoraAdapters | None  # lora: what apply_lora added; None without LoRA


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
            exceeds it, the report warns and names the first regime that fits (:func:`_fitting_regime`).

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


def _compute_bytes(cfg: JobConfig) -> int:
    return 4 if cfg.parallel.param_dtype == "float32" else 2


def _compute_dtype(cfg: JobConfig) -> torch.dtype:
    """The dtype the planned GPU job computes in (where LoRA holds its frozen base)."""
    return compute_dtype(cfg, "cuda")


def _build(cfg: JobConfig, mcfg: Any, nnodes: int, nproc_per_node: int, rank: int, table: bool) -> _Built:
    """Build the job on meta under the fake backend as ``rank`` (the layout already checked)."""
    world = nnodes * nproc_per_node
    _, expert_reshard = parallel_options(cfg).resharding(world)
    lines: list[str] = []
    with fake_process_group(world, rank):
        meshes = build_meshes(
            cfg.parallel.ep_size,
            ranks_per_node=nproc_per_node,
            device_type="cpu",
            allow_cross_node_ep=cfg.parallel.allow_cross_node_ep,
            sp_size=cfg.parallel.sp_size,
        )
        with torch.device("meta"):
            model = family_of(mcfg).model_class(mcfg)
        adapters = None
        if cfg.lora.enabled:  # as the job: before parallelize, the frozen base in the compute dtype
            adapters = apply_lora(model, cfg.lora, seed=cfg.train.seed, base_dtype=_compute_dtype(cfg))
        parallel = parallelize(model, meshes, parallel_options(cfg))
        info, units = parallel.ep_info, parallel.units
        lines.append(meshes.describe())
        lines += ["options:", *(f"  {line}" for line in parallel.options.describe())]
        trains = "the adapters" if adapters is not None else "every parameter"
        lines.append(f"  optimizer: AdamW on {trains}, fuse_local_experts={cfg.train.fuse_local_experts}")
        lines.append("")
        header = f"{'parameter':62s} {'global shape':>22s} {'local shape':>22s}  placement"
        if table:
            lines.append(header)
            lines.append("-" * len(header))
        (local_numel, total_numel), trained = _parameter_rows(model, info, lines if table else None)
        u = _unit_figures(units, meshes, cfg, expert_reshard, _expert_grad_bytes(cfg))
    return _Built(lines, parallel.options, meshes.ep_size, local_numel, total_numel, u, *trained, adapters)


def _lora_line(built: _Built) -> str:
    """The report's LoRA line: the options, the targets, the adapters' elements."""
    a = built.adapters
    assert a is not None
    return (
        f"{a.describe()}; adapter parameters: {built.trained_total / 1e6:.2f} M in total, "
        f"{built.trained_local / 1e6:.2f} M on this rank (the base frozen in the compute dtype)"
    )


def _memory_estimate(cfg: JobConfig, mcfg: Any, built: _Built, world: int, mb: int, opts: Any) -> MemoryEstimate:
    """The memory per rank of the job ``built`` on ``world`` ranks at micro-batch ``mb`` with the options ``opts``
    (the activation checkpointing and micro-batch change no FSDP unit: one build serves every such regime)."""
    t, u = cfg.train, built.units
    reshard, _ = opts.resharding(world)
    compute_bytes = _compute_bytes(cfg)
    sp = cfg.parallel.sp_size  # a rank holds 1/sp of each of its data-parallel group's rows
    tokens = mb * cfg.data.seq_len // sp
    micro_batches = max(1, t.global_batch_size // (world // sp) // mb)
    deferred_sync = gradient_sync(t, world) == "last_micro_batch"
    fused_grads = compute_bytes * u.fused_numel
    # train.expert_weight_grads: the local experts' gradients kept as factors where the optimizer defers them (the
    # base's weight gradients: a frozen base has none, and the adapters' are formed at each backward)
    ratio = _kept_factor_ratio(mcfg, tokens, micro_batches, built.ep_size, opts.ep.dispatch)
    budget = expert_grad_budget(t.expert_weight_grads, ratio)
    lora = built.adapters is not None
    if micro_batches > 1 and u.fused_numel and budget is not None and ratio <= budget and not lora:
        fused_grads = int(fused_grads * ratio)
    head_held = micro_batches > 1 and deferred_sync  # FSDP2 holds the head's float32 gradient between micro-batches
    over_logits = loss_head_over_logits(opts, compute_bytes)
    # What trains gets a float32 master, a gradient and AdamW's two moments; a frozen base (lora) is held once, in
    # the compute dtype, and nothing else. Local experts the fused pass updates hold their 4 bytes of master as the
    # parameter (bf16: its high half, beside 2 bytes of low halves in the optimizer; float32: the master itself) and
    # no other compute copy (see _unit_figures).
    trained, frozen = built.trained_local, built.local_numel - built.trained_local
    activations = activation_bytes_per_token(
        mcfg, compute_bytes, opts.activation_checkpointing, opts.selective_recompute, opts.keep_attention
    )
    if lora:
        activations += adapter_activation_bytes_per_token(
            built.adapters, mcfg.num_hidden_layers, compute_bytes, opts.activation_checkpointing
        )
    return MemoryEstimate(
        params=4 * trained + compute_bytes * frozen,
        grads=4 * (trained - u.fused_numel) + fused_grads,
        optimizer=8 * trained,
        # Where no unit reshards after forward (one rank, or parallel.reshard_after_forward false with the experts
        # following), every unit's compute copy lives through the step; else the stages in flight at once (one and
        # those prefetched after it), beside those kept from forward to backward.
        unsharded=compute_bytes * (u.all_numel if not reshard and u.experts_kept else u.in_flight + u.kept_numel),
        reduce_buffers=u.reduce_buffers,
        activations=activations * tokens,
        micro_batches=micro_batches,
        held_grads=u.held_grads if deferred_sync else 0,
        loss_head=loss_head_bytes(mcfg, compute_bytes, tokens, head_held, over_logits, u.head_trains),
        loss_head_adds=u.head_trains and head_adds_in_backward(compute_bytes, tokens, head_held),
        loss_head_over_logits=over_logits,
    )


def _exceeds(
    cfg: JobConfig,
    mcfg: Any,
    built: _Built,
    est: MemoryEstimate,
    nnodes: int,
    nproc_per_node: int,
    mb: int,
    gpu_memory: tuple[str, float],
    context: ContextFit | None = None,
) -> str:
    where, gib = gpu_memory
    head = f"warning: the estimated peak {est.total / GiB:.2f} GiB exceeds the {gib:.2f} GiB of {where}"
    fit = _fitting_regime(cfg, mcfg, built, nnodes, nproc_per_node, mb, gib * GiB)
    if fit is None and context is not None and context.fits:  # longer rows: splitting them is what fits
        fit = context.flags, context.total
    if fit is None:
        return (
            f"{head}; no regime tried fits (activation checkpointing selective and full, micro-batches down to 1, EP "
            f"up to the {nproc_per_node} ranks of a node, up to {4 * nnodes} nodes, sp up to {nproc_per_node}): "
            "plan a larger cluster"
        )
    flags, total = fit
    return f"{head}; fits with {flags} ({total / GiB:.2f} GiB)"


def _regimes(cfg: JobConfig, opts: Any, mb: int, world: int) -> list[tuple[str, int]]:
    """``(activation checkpointing, micro-batch)`` to try, least costly in step time first: selective
    checkpointing, then smaller micro-batches, then full checkpointing with each micro-batch (the order of their
    measured costs per step: ``docs/performance.md``)."""
    ladder = ("none", "selective", "full")
    current = opts.activation_checkpointing
    per_rank = cfg.train.global_batch_size // (world // cfg.parallel.sp_size)  # rows of a data-parallel group
    sizes = [m for m in range(mb, 0, -1) if per_rank % m == 0]
    out = []
    for ac in ladder[max(1, ladder.index(current)) :]:
        out += [(ac, m) for m in sizes if (ac, m) != (current, mb)]
    return out


def _fitting_regime(
    cfg: JobConfig, mcfg: Any, built: _Built, nnodes: int, nproc_per_node: int, mb: int, limit: float
) -> tuple[str, int] | None:
    """The first regime whose estimate is within ``limit`` bytes, as ``(its flags, its estimate)``; None if none.

    Tried in order: on this layout, the checkpointing and micro-batch regimes of :func:`_regimes` (estimated from
    the one build); then the job's own regime and those with a larger EP size inside the node, then with 2 and 4
    times the nodes (more ep_fsdp ranks): each layout training accepts (:func:`check_layout`) is built once.
    """
    layouts: list[tuple[list[str], int, dict[str, Any]]] = [([], nnodes, {})]
    ep = cfg.parallel.ep_size * 2
    while ep <= nproc_per_node:
        layouts.append(([f"--parallel.ep_size={ep}"], nnodes, {"ep_size": ep}))
        ep *= 2
    layouts += [([f"--nnodes {nnodes * k}"], nnodes * k, {}) for k in (2, 4)]
    for i, (flags, n, parallel) in enumerate(layouts):
        world = n * nproc_per_node
        c = _with(cfg, parallel=parallel) if parallel else cfg
        if i:
            try:  # at micro-batch 1: the regimes below try the micro-batches that divide a rank's rows
                check_layout(_with(c, train={"micro_batch_size": 1}), world_size=world, ranks_per_node=nproc_per_node)
            except ConfigError:
                continue  # a layout training refuses (the EP size and the experts, the global batch)
            b = _build(c, mcfg, n, nproc_per_node, 0, table=False)
            same = c.train.global_batch_size // world % mb == 0  # the job's own micro-batch still divides
            regimes = [(b.options.activation_checkpointing, mb)] if same else []
        else:
            b, regimes = built, []
        for ac, m in regimes + _regimes(c, b.options, mb, world):
            r = _with(c, parallel={"activation_checkpointing": ac}) if ac != b.options.activation_checkpointing else c
            total = _memory_estimate(r, mcfg, b, world, m, parallel_options(r)).total
            if total <= limit:
                same_ac = ac == built.options.activation_checkpointing
                extra = [] if same_ac else [f"--parallel.activation_checkpointing={ac}"]
                extra += [f"--train.micro_batch_size={m}"] if m != mb else []
                return " ".join(flags + extra), total
    return None


@dataclass(frozen=True)
class ContextFit:
    """The smallest sequence-parallel size whose regime holds the job's rows within a GPU's memory
    (:func:`_context_fit`), or, where none does, the regime that comes closest."""

    seq_len: int
    fits: bool
    sp_size: int
    activation_checkpointing: str
    micro_batch_size: int
    total: float  # bytes per GPU: that regime's estimate
    flags: str  # what to change from the job's config to get it ("" for nothing)

    def line(self, gib: float, world: int) -> str:
        """One line for ``plan``'s report against a GPU of ``gib`` GiB, the job on ``world`` GPUs."""
        regime = (
            f"{self.activation_checkpointing} activation checkpointing, micro-batch {self.micro_batch_size}: "
            f"{self.total / GiB:.2f} GiB"
        )
        if not self.fits:
            return (
                f"context: rows of {self.seq_len} tokens fit {gib:.2f} GiB per GPU at no sp on these {world} GPUs "
                f"(the least: sp {self.sp_size}, {regime}); use more GPUs or a shorter data.seq_len"
            )
        change = self.flags or "the job as configured"
        return (
            f"context: rows of {self.seq_len} tokens fit {gib:.2f} GiB per GPU from sp {self.sp_size} ({regime}): "
            f"{change}"
        )


def _context_fit(
    cfg: JobConfig, mcfg: Any, built: _Built, nnodes: int, nproc_per_node: int, mb: int, limit: float
) -> ContextFit | None:
    """The smallest sp (a divisor of the ranks per node that training accepts for this job) at which some regime
    of :func:`_regimes` (the job's own first) holds its rows within ``limit`` bytes; where none does, the least
    estimate tried. None where no sp is accepted at all.

    One build serves every sp: a rank's parameters, their FSDP units and shards are the same at any sp (FSDP spans
    every rank); sp changes the tokens a rank holds and the micro-batches of a step, which the estimate takes from
    the config.
    """
    world = nnodes * nproc_per_node
    least: ContextFit | None = None
    for sp in (s for s in range(1, nproc_per_node + 1) if nproc_per_node % s == 0):
        keys: dict[str, Any] = {"sp_size": sp}
        if sp > 1 and cfg.parallel.compile:  # training refuses the attention's all-to-alls inside a compiled half
            keys["compile"] = False
        c = _with(cfg, parallel=keys)
        try:
            check_layout(_with(c, train={"micro_batch_size": 1}), world_size=world, ranks_per_node=nproc_per_node)
        except ConfigError:
            continue  # an sp that does not divide the heads or seq_len, a global batch too small for its groups
        opts = parallel_options(c)
        rows = c.train.global_batch_size // (world // sp)
        own = [(opts.activation_checkpointing, mb)] if rows % mb == 0 else []
        for ac, m in own + _regimes(c, opts, mb, world):
            r = _with(c, parallel={"activation_checkpointing": ac}) if ac != opts.activation_checkpointing else c
            total = _memory_estimate(r, mcfg, built, world, m, parallel_options(r)).total
            flags = [f"--parallel.{k}={str(v).lower()}" for k, v in keys.items() if getattr(cfg.parallel, k) != v]
            flags += (
                [f"--parallel.activation_checkpointing={ac}"] if ac != cfg.parallel.activation_checkpointing else []
            )
            flags += [f"--train.micro_batch_size={m}"] if m != mb else []
            fit = ContextFit(cfg.data.seq_len, total <= limit, sp, ac, m, total, " ".join(flags))
            if fit.fits:
                return fit
            if least is None or total < least.total:
                least = fit
    return least


def _with(cfg: JobConfig, **sections: dict[str, Any]) -> JobConfig:
    """``cfg`` with some keys of some sections changed (through the config's own loader and checks)."""
    d = cfg.to_dict()
    for name, keys in sections.items():
        d[name] = {**d[name], **keys}
    return config_from_dict(d)


def _parameter_rows(
    model: torch.nn.Module, info: Any, lines: list[str] | None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((elements on this rank, elements in all), the same of those that train)`` of the model's parameters (a
    parameter trains where it requires a gradient: all without LoRA, the adapters with it); with ``lines``, one row
    each."""
    numel, trained = [0, 0], [0, 0]
    for name, p in model.named_parameters():
        meta = info.params.get(name) if info is not None else None
        gshape = tuple(meta.global_shape) if meta is not None else tuple(p.shape)
        lshape = tuple(_local(p))
        sizes = int(torch.Size(lshape).numel()), int(torch.Size(gshape).numel())
        for counts in (numel, trained) if p.requires_grad else (numel,):
            counts[0] += sizes[0]
            counts[1] += sizes[1]
        if lines is not None:
            frozen = "" if p.requires_grad else "  (frozen)"
            placement = _placement(p, meta)
            lines.append(f"{name:62s} {str(list(gshape)):>22s} {str(list(lshape)):>22s}  {placement}{frozen}")
    return (numel[0], numel[1]), (trained[0], trained[1])


class _UnitFigures(NamedTuple):
    in_flight: int  # elements gathered at once beyond the kept units: a stage and the ones prefetched after it
    reduce_buffers: int  # bytes of the largest stage's gradient reduce buffers
    once_numel: int  # gathered once per micro-batch (the root and the head)
    kept_numel: int  # unsharded from forward to backward
    all_numel: int  # every unit's and every local expert's elements, unsharded
    experts_kept: bool  # the experts' compute copies live from forward to backward
    fused_numel: int  # experts updated by the fused pass (compute-dtype gradients)
    held_grads: int  # bytes of unsharded gradients held with gradient_sync last_micro_batch
    head_trains: bool  # the LM head's weight gets a gradient (not a frozen base's, lora)
    adapter_numel: tuple[int, int]  # unsharded elements that train, outside the expert units and in them (lora)


def _unit_figures(
    units: Any, meshes: Any, cfg: JobConfig, expert_reshard: bool, expert_reduce_bytes: int
) -> _UnitFigures:
    """What the FSDP units gather, keep and reduce (for the memory and communication estimates)."""
    # Expert modules kept out of FSDP (ep_fsdp of one rank) belong to no unit's gathered parameters.
    local_experts = dict(units.local_experts)
    all_units = {id(m) for stage in units.stages for _, m in stage.modules} | {id(units.root)}
    skip = all_units | {id(m) for m in local_experts.values()}

    head = units.stages[-1].modules[0][1]
    # Gathered once per micro-batch (never resharded after forward): the root and the head (see shard_model).
    once_numel = _managed_numel(units.root, skip) + _managed_numel(head, skip)
    # Unsharded from forward to backward: the root and the head (see shard_model), and the experts when ep_fsdp
    # has one rank (their compute-dtype copies, saved for backward) or they are not resharded after forward
    # (parallel.expert_reshard_after_forward); these live through the whole step.
    experts_kept = meshes.ep_fsdp_size == 1 or not expert_reshard
    kept = [units.root, head] + ([m for _, m in units.experts] if experts_kept else [])
    kept_numel = sum(_managed_numel(m, skip) for m in kept)
    # Experts outside FSDP: a frozen base (lora) in the compute dtype is its own compute copy (counted with the
    # parameters); what trains is cast to the compute dtype for the pass, except under the fused update
    # (train.fuse_local_experts), where the parameter is the compute copy and part of the master: its high half in
    # bf16 (moeshard.fsdp_moe.split_master), the master itself in float32, counted with the parameters.
    cast = 0 if cfg.train.fuse_local_experts else 1
    local_cast = cast * sum(_managed_numel(m, skip, trained_only=True) for m in local_experts.values())
    kept_numel += local_cast
    kept_ids = {id(m) for m in kept} | {id(m) for m in local_experts.values()}
    all_numel = sum(_managed_numel(m, skip) for _, m in units) + local_cast

    def stage_numel(stage: Any) -> int:
        # What a stage gathers beyond the kept units (counted once, above); its local experts are kept.
        return sum(_managed_numel(m, skip) for _, m in stage.modules if id(m) not in kept_ids)

    gathered = [stage_numel(stage) for stage in units.stages]
    depth = cfg.parallel.prefetch_depth
    in_flight = max(sum(gathered[i : i + 1 + depth]) for i in range(len(gathered)))
    # Bytes per element of the gradients FSDP reduces (and holds unsharded): float32, the expert units' in
    # parallel.expert_reduce_dtype.
    expert_units = {id(m) for _, m in units.experts}

    def grad_bytes(unit: Any) -> int:
        # only what trains has a gradient to reduce (a frozen base, lora, none)
        elem = expert_reduce_bytes if id(unit) in expert_units else 4
        return _managed_numel(unit, skip, trained_only=True) * elem

    def stage_grad_bytes(stage: Any) -> int:
        # (local experts reduce nothing: their gradients stay where backward adds them)
        return sum(grad_bytes(m) for _, m in stage.modules)

    reduce_buffers = max(stage_grad_bytes(stage) for stage in units.stages)  # the largest stage's, in backward
    # Experts outside FSDP updated by the fused pass keep their gradients in the compute dtype.
    fused_numel = sum(p.numel() for m in local_experts.values() for p in m.parameters() if p.requires_grad)
    fused_numel = fused_numel if cfg.train.fuse_local_experts else 0

    # train.gradient_sync last_micro_batch: every FSDP unit holds its unsharded gradients until the step's last
    # backward reduces them, in the reduce dtype (FSDP2 accumulates in it), instead of its shard of them (counted
    # in the gradients): (n - 1) / n of them more over a shard group of n ranks, nothing on one rank (the same
    # measured peak as every_micro_batch there).
    def shards(unit: Any) -> int:
        return meshes.ep_fsdp_size if id(unit) in expert_units else meshes.world_size

    held_grads = sum(grad_bytes(m) * (shards(m) - 1) // shards(m) for _, m in units)
    head_trains = any(p.requires_grad for p in head.parameters() if p.dim() == 2)
    # What each unit reduce-scatters (a frozen base, lora, nothing): outside the experts and this EP rank's experts'.
    trained = [(id(m) in expert_units, _managed_numel(m, skip, trained_only=True)) for _, m in units]  # root too
    adapter_numel = (sum(n for e, n in trained if not e), sum(n for e, n in trained if e))
    return _UnitFigures(
        in_flight,
        reduce_buffers,
        once_numel,
        kept_numel,
        all_numel,
        experts_kept,
        fused_numel,
        held_grads,
        head_trains,
        adapter_numel,
    )


def _expert_grad_bytes(cfg: JobConfig) -> int:
    """Bytes per element of the expert units' gradient reduce-scatter (``parallel.expert_reduce_dtype``)."""
    return 2 if cfg.parallel.expert_reduce_dtype == "bfloat16" else 4


def _managed_numel(unit: torch.nn.Module, skip: set[int], trained_only: bool = False) -> int:
    """Unsharded elements of the parameters of ``unit`` and its submodules, except those of the modules in
    ``skip`` (other units, and expert modules outside FSDP): what one FSDP unit gathers (``trained_only``: of the
    parameters that require a gradient, what it reduces)."""
    total, stack = 0, [unit]
    while stack:
        m = stack.pop()
        total += sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad or not trained_only)
        stack.extend(c for c in m.children() if id(c) not in skip)
    return total


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
