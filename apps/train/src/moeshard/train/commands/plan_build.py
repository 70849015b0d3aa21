"""The job of ``moeshard-train plan`` built on meta under the fake backend (:func:`_build`): its parameter rows, what
its FSDP units gather, keep and reduce (:class:`_UnitFigures`), and the memory per rank a regime of it holds
(:func:`_memory_estimate`, the model of ``plan_memory.py`` filled in). ``plan.py`` reports them, ``plan_regimes.py``
searches them for the regimes that fit a GPU."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from moeshard.ep import kept_factor_elements
from moeshard.fsdp_moe import expert_grad_budget, kept_factor_ratio
from moeshard.lora import LoraAdapters, apply_lora
from moeshard.meshes import build_meshes, fake_process_group
from moeshard.models.common import parallelize
from moeshard.train.commands.plan_memory import (
    MemoryEstimate,
    activation_bytes_per_token,
    adapter_activation_bytes_per_token,
    head_adds_in_backward,
    loss_head_bytes,
    loss_head_over_logits,
)
from moeshard.train.config import JobConfig, gradient_sync, parallel_options
from moeshard.train.families import family_of
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
    # the gate/up delta is what adds input gradients to the expert pass (moeshard.ep.backward_elements)
    lowrank_experts = lora and any(t.kind != "linear" and "gate_up" in t.param for t in built.adapters.targets)
    per_token = functools.partial(
        activation_bytes_per_token,
        mcfg,
        compute_bytes,
        opts.activation_checkpointing,
        opts.selective_recompute,
        opts.keep_attention,
        dispatch=opts.ep.dispatch,
        ep_size=built.ep_size,
        lowrank_experts=lowrank_experts,
    )
    activations, first_layer = per_token(), per_token(first_layer=True)  # every layer's; the first one's recompute
    if lora:
        adapter = adapter_activation_bytes_per_token(
            built.adapters, mcfg.num_hidden_layers, compute_bytes, opts.activation_checkpointing
        )
        activations, first_layer = activations + adapter, first_layer + adapter
    grads = 4 * (trained - u.fused_numel) + fused_grads
    return MemoryEstimate(
        params=4 * trained + compute_bytes * frozen,
        grads=grads,
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
        # backward forms the first stage's gradients (the embedding's) after the first decoder layer's
        first_layer=first_layer * tokens,
        late_grads=grads - u.first_stage_grads,
        late_reduce_buffers=u.block_reduce_buffers,
    )


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
    first_stage_grads: int  # bytes of this rank's gradients of the first stage (the embedding's): backward's last
    block_reduce_buffers: int  # bytes of the largest decoder block's reduce buffers (stages but the first and last)
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
    block_reduce_buffers = max((stage_grad_bytes(stage) for stage in units.stages[1:-1]), default=0)
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
    # This rank's gradients of the first stage, as the estimate's grads count them: a float32 shard where FSDP
    # holds it, the compute dtype for local experts the fused pass updates.
    first = units.stages[0]
    local_bytes = _compute_bytes(cfg) if cfg.train.fuse_local_experts else 4
    first_stage_grads = sum(4 * _managed_numel(m, skip, trained_only=True, local=True) for _, m in first.modules)
    first_stage_grads += sum(
        local_bytes * _managed_numel(m, set(), trained_only=True, local=True)
        for fqn, m in local_experts.items()
        if fqn in first.local_experts
    )
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
        first_stage_grads,
        block_reduce_buffers,
        adapter_numel,
    )


def _expert_grad_bytes(cfg: JobConfig) -> int:
    """Bytes per element of the expert units' gradient reduce-scatter (``parallel.expert_reduce_dtype``)."""
    return 2 if cfg.parallel.expert_reduce_dtype == "bfloat16" else 4


def _managed_numel(unit: torch.nn.Module, skip: set[int], trained_only: bool = False, local: bool = False) -> int:
    """Unsharded elements of the parameters of ``unit`` and its submodules, except those of the modules in
    ``skip`` (other units, and expert modules outside FSDP): what one FSDP unit gathers (``trained_only``: of the
    parameters that require a gradient, what it reduces; ``local``: this rank's shard of them instead)."""
    total, stack = 0, [unit]
    while stack:
        m = stack.pop()
        params = [p for p in m.parameters(recurse=False) if p.requires_grad or not trained_only]
        total += sum(_local(p).numel() if local else p.numel() for p in params)
        stack.extend(c for c in m.children() if id(c) not in skip)
    return total
