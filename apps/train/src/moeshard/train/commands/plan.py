"""``moeshard-train plan``: the job's layout on the fake backend, no GPU and no communication.

Prints the meshes and groups, one row per parameter (global shape, this rank's local shape and placement), the
estimated memory per rank and the estimated communication per step by kind and by link (intra/inter-node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from moeshard.train.config import (
    JobConfig,
    expert_grad_budget,
    gradient_sync,
    kept_factor_ratio,
    layout_error_for_config,
    parallel_options,
    resolve_model_config,
)

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank; ``total`` is what to compare with the peak allocated memory."""

    params: int
    grads: int
    optimizer: int
    unsharded: int
    activations: int
    micro_batches: int = 1
    held_grads: int = 0
    loss_head: int = 0
    reduce_buffers: int = 0
    loss_head_adds: bool = False  # the head adds its weight gradient into a held one in backward (loss_head_bytes)

    @property
    def total(self) -> int:
        """The peak. The forward's end holds the saved activations and the loss head's (``loss_head``); backward
        holds the gradients and, where a stage's gradients are reduced, its reduce buffers (``reduce_buffers``).
        With one micro-batch per step the two do not add up: the activations are freed as the gradients appear.
        With several, the gradients of the earlier micro-batches are alive beside the last one's activations, and
        with ``train.gradient_sync: last_micro_batch`` also FSDP's unsharded float32 gradients (``held_grads``).
        (One H200, 8 layers, EP 1, 4 x 4096 tokens per step, 128 and 16 experts: within 1.6% of the measured peak
        allocated at micro-batch 4, 2 and 1 and with selective and full checkpointing; see benchmarks/NOTES.md.)"""
        saved = self.activations + self.loss_head
        base = self.params + self.optimizer + self.unsharded
        if self.micro_batches > 1:
            return base + self.grads + self.held_grads + max(saved, self.reduce_buffers)
        return base + max(saved, self.grads + self.reduce_buffers)


def _size(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:8.2f} MiB"


def _placement(p: Any, expert_meta: Any) -> str:
    from torch.distributed.tensor import DTensor

    parts = []
    if expert_meta is not None:
        parts.append(f"ep:Shard(0)x{expert_meta.ep_size}")
    if isinstance(p, DTensor):
        names = p.device_mesh.mesh_dim_names or ("?",)
        parts += [f"{n}:{pl}x{p.device_mesh.size(i)}" for i, (n, pl) in enumerate(zip(names, p.placements))]
    return " ".join(parts) or "replicated"


def _local(p: Any) -> torch.Size:
    from torch.distributed.tensor import DTensor

    return p.to_local().shape if isinstance(p, DTensor) else p.shape


def activation_bytes_per_token(
    config: Any,
    compute_bytes: int,
    activation_checkpointing: str = "none",
    selective_recompute: str = "activation",
    keep_attention: bool = False,
) -> int:
    """Saved activations per token of one training micro-batch, all layers + the loss head.

    Without activation checkpointing every layer keeps its activations; with ``full``, each layer keeps only its
    input (and with ``keep_attention`` what the family says its layer keeps, ``ModelFamily.kept_attention_per_token``:
    the attention's output and log-sum-exp, the output projection's output; packed rows recompute the attention, so
    there the estimate is high by the attention's part) and one layer at a time is recomputed in backward; with
    ``selective`` every layer keeps its activations but the routed copies' gated activation (``activation``: ``F``
    elements per copy) or also their gate/up output (``mlp``: ``3F``). A routed copy keeps ``D + 3F``: its row into
    the experts, the gate/up output and the gated activation (the expert pass applies the routing weight, so nothing
    of its output is kept for that gradient).
    The loss head is chunked (the trainer never holds the ``[tokens, vocab]`` logits): per token it keeps the
    hidden states and their gradient (its ``[V, D]`` weight gradient and one chunk's logits are
    :func:`loss_head_bytes`).
    """
    from moeshard.train.families import family_of, routed_experts

    d, e, k, f = config.hidden_size, routed_experts(config), config.num_experts_per_tok, config.moe_intermediate_size
    attn_elems, mlp_elems = family_of(config).activations_per_token(config)  # the family's attention, shared experts
    attn = compute_bytes * (4 * d + attn_elems) + 4 * config.num_attention_heads  # norms, projections, sdpa out + lse
    moe = compute_bytes * (2 * d + k * (d + 3 * f) + mlp_elems) + 4 * (2 * e + 3 * k)  # dispatch ... router
    if activation_checkpointing == "selective":
        moe -= compute_bytes * k * (f if selective_recompute == "activation" else 3 * f)
    head = 2 * d * compute_bytes
    layers = config.num_hidden_layers
    if activation_checkpointing == "full":
        kept = family_of(config).kept_attention_per_token if keep_attention else None
        kept_elems, kept_floats = kept(config) if kept is not None else (0, 0)
        return layers * ((d + kept_elems) * compute_bytes + 4 * kept_floats) + (attn + moe) + head
    return layers * (attn + moe) + head


def loss_head_bytes(config: Any, compute_bytes: int, tokens: int, held: bool = False) -> int:
    """What the chunked loss head (``moeshard.models.common.linear_cross_entropy``) holds at the forward's end
    beyond the per-token activations: the ``[V, D]`` weight gradient it computes in forward and keeps for backward
    (float32: it is handed to FSDP2's float32 gradient, or kept in float32 compute), and one chunk's logits and
    their gradient (``2 x chunk x V`` in the compute dtype) while the last chunk's loss is computed.

    ``held``: FSDP2 holds the head's float32 gradient from an earlier micro-batch (several micro-batches with
    ``gradient_sync: last_micro_batch``). A bf16 micro-batch of one chunk then keeps its logit gradient for backward,
    which adds its product into the held gradient, and makes no ``[V, D]`` float32 gradient of its own."""
    from moeshard.models.common import LOSS_CHUNK_TOKENS

    v, d = config.vocab_size, config.hidden_size
    chunk = 2 * min(LOSS_CHUNK_TOKENS, tokens) * v * compute_bytes
    return chunk if head_adds_in_backward(compute_bytes, tokens, held) else 4 * v * d + chunk


def head_adds_in_backward(compute_bytes: int, tokens: int, held: bool) -> bool:
    """Whether the loss head's micro-batch keeps its logit gradient and adds its weight-gradient product into the
    float32 gradient FSDP2 holds (see :func:`loss_head_bytes`): bf16 compute, one chunk, a gradient held."""
    from moeshard.models.common import LOSS_CHUNK_TOKENS

    return held and compute_bytes == 2 and tokens <= LOSS_CHUNK_TOKENS


@dataclass(frozen=True)
class PlanReport:
    """The dry run's findings: the printed text and the figures behind it."""

    text: str
    memory: MemoryEstimate
    comm: dict[tuple[str, str], float]  # (kind, "intra-node" | "inter-node") -> bytes per rank per step
    comm_bound: dict[tuple[str, str], float]  # the same with the all-to-all upper bound


def plan(
    cfg: JobConfig,
    *,
    nnodes: int,
    nproc_per_node: int,
    rank: int = 0,
    micro_batch_size: int | None = None,
    table: bool = True,
) -> str:
    """Build the job on meta under the fake backend as ``rank`` and describe it (see :func:`plan_report`)."""
    return plan_report(
        cfg, nnodes=nnodes, nproc_per_node=nproc_per_node, rank=rank, micro_batch_size=micro_batch_size, table=table
    ).text


def plan_report(
    cfg: JobConfig,
    *,
    nnodes: int,
    nproc_per_node: int,
    rank: int = 0,
    micro_batch_size: int | None = None,
    table: bool = True,
) -> PlanReport:
    """Build the job on meta under the fake backend as ``rank`` (through ``parallelize`` with the job's options):
    meshes, options, parameter rows (``table=False``: left out, ``plan --summary``), memory and communication.

    Compute precision: ``parallel.param_dtype`` float32 means fp32, anything else bf16 (the GPU default).

    Raises:
        ValueError: the layout does not fit the cluster (naming the config key to change).
    """
    from moeshard.meshes import build_meshes, fake_process_group
    from moeshard.models.common import parallelize
    from moeshard.train.families import family_of

    world = nnodes * nproc_per_node
    mcfg = resolve_model_config(cfg)
    reshard, expert_reshard = parallel_options(cfg).resharding(world)
    expert_reduce_bytes = _expert_grad_bytes(cfg)
    gpu = cfg.parallel.param_dtype != "float32"
    compute_bytes = 2 if gpu else 4
    lines: list[str] = []
    with fake_process_group(world, rank):
        try:
            meshes = build_meshes(
                cfg.parallel.ep_size,
                ranks_per_node=nproc_per_node,
                device_type="cpu",
                allow_cross_node_ep=cfg.parallel.allow_cross_node_ep,
            )
        except ValueError as e:  # the package speaks of its argument; the user sets a config key
            raise ValueError(f"parallel.ep_size: {layout_error_for_config(e)}") from None
        with torch.device("meta"):
            model = family_of(mcfg).model_class(mcfg)
        parallel = parallelize(model, meshes, parallel_options(cfg))
        info, units = parallel.ep_info, parallel.units
        lines.append(meshes.describe())
        lines += ["options:", *(f"  {line}" for line in parallel.options.describe())]
        lines.append(f"  optimizer: AdamW, fuse_local_experts={cfg.train.fuse_local_experts}")
        lines.append("")
        header = f"{'parameter':62s} {'global shape':>22s} {'local shape':>22s}  placement"
        if table:
            lines.append(header)
            lines.append("-" * len(header))
        local_numel, total_numel = _parameter_rows(model, info, lines if table else None)
        u = _unit_figures(units, meshes, cfg, expert_reshard, expert_reduce_bytes)
    mb = micro_batch_size or cfg.train.micro_batch_size
    tokens = mb * cfg.data.seq_len
    t, opts = cfg.train, parallel.options  # the options as ParallelOptions reads them (true: full)
    micro_batches = max(1, t.global_batch_size // world // mb)
    deferred_sync = gradient_sync(t, world) == "last_micro_batch"
    fused_grads = compute_bytes * u.fused_numel
    # train.expert_weight_grads: the local experts' gradients kept as factors where train_step defers them
    ratio = kept_factor_ratio(mcfg, tokens, micro_batches, meshes.ep_size, opts.ep.dispatch)
    budget = expert_grad_budget(t, ratio)
    if micro_batches > 1 and u.fused_numel and budget is not None and ratio <= budget:
        fused_grads = int(fused_grads * ratio)
    # Local experts the fused pass updates in bf16 hold their float32 masters split: the bf16 parameter (counted with
    # the compute copies below) and 2 bytes of low halves (moeshard.fsdp_moe.split_master), not 4 bytes of master.
    split_numel = u.fused_numel if compute_bytes == 2 else 0
    est = MemoryEstimate(
        params=4 * local_numel - 2 * split_numel,
        grads=4 * (local_numel - u.fused_numel) + fused_grads,
        optimizer=8 * local_numel,
        # Where no unit reshards after forward (one rank, or parallel.reshard_after_forward false with the experts
        # following), every unit's compute copy lives through the step; else the stages in flight at once (one and
        # those prefetched after it), beside those kept from forward to backward.
        unsharded=compute_bytes * (u.all_numel if not reshard and u.experts_kept else u.in_flight + u.kept_numel),
        reduce_buffers=u.reduce_buffers,
        activations=activation_bytes_per_token(
            mcfg, compute_bytes, opts.activation_checkpointing, opts.selective_recompute, opts.keep_attention
        )
        * tokens,
        micro_batches=micro_batches,
        held_grads=u.held_grads if deferred_sync else 0,
        loss_head=loss_head_bytes(mcfg, compute_bytes, tokens, held=micro_batches > 1 and deferred_sync),
        loss_head_adds=head_adds_in_backward(compute_bytes, tokens, micro_batches > 1 and deferred_sync),
    )
    if table:
        lines.append("")
    lines.append(f"parameters: {total_numel / 1e9:.3f} B in total, {local_numel / 1e6:.2f} M on rank {rank}")
    lines += _memory_lines(est, opts, mb, cfg.data.seq_len, compute_bytes, expert_reduce_bytes)
    lines.append("")
    comm = comm_estimate(cfg, mcfg, world, nproc_per_node, compute_bytes, u.once_numel)
    bound = comm_estimate(cfg, mcfg, world, nproc_per_node, compute_bytes, u.once_numel, uniform_routing=False)
    lines += comm_estimate_lines(comm, bound)
    return PlanReport("\n".join(lines), est, comm, bound)


def _memory_lines(
    est: MemoryEstimate, opts: Any, mb: int, seq_len: int, compute_bytes: int, expert_reduce_bytes: int
) -> list[str]:
    """The memory estimate's lines of the report."""
    lines: list[str] = []
    ac = {"none": "no", "full": "full", "selective": f"selective ({opts.selective_recompute})"}
    ac = ac[opts.activation_checkpointing]
    lines.append(
        f"estimated memory per rank (micro batch {mb} x seq {seq_len} x {est.micro_batches} per step, "
        f"{ac} activation checkpointing, {'bf16' if compute_bytes == 2 else 'fp32'} compute, fp32 master weights, "
        "AdamW):"
    )
    for k in ("params", "grads", "optimizer", "unsharded", "activations"):
        lines.append(f"  {k:12s} {_size(getattr(est, k))}")
    kept = (
        "one chunk's logits and their gradient, its product added into the held gradient in backward"
        if est.loss_head_adds
        else "[V, D] float32 weight gradient, one chunk's logits"
    )
    lines.append(f"  {'loss head':12s} {_size(est.loss_head)}  ({kept})")
    lines.append(f"  {'reduce bufs':12s} {_size(est.reduce_buffers)}  (the largest stage's, in backward)")
    if est.held_grads and est.micro_batches > 1:
        dtype = "fp32" if expert_reduce_bytes == 4 else "fp32, experts' bf16"
        lines.append(
            f"  {'held grads':12s} {_size(est.held_grads)}  (gradient_sync last_micro_batch: unsharded {dtype})"
        )
    held = "alive together" if est.micro_batches > 1 else "not alive together"
    lines.append(f"  {'total':12s} {_size(est.total)}  (peak: activations and gradients are {held})")
    return lines


def _parameter_rows(model: torch.nn.Module, info: Any, lines: list[str] | None) -> tuple[int, int]:
    """``(elements on this rank, elements in all)`` of the model's parameters; with ``lines``, one row each."""
    local_numel = 0
    total_numel = 0
    for name, p in model.named_parameters():
        meta = info.params.get(name) if info is not None else None
        gshape = tuple(meta.global_shape) if meta is not None else tuple(p.shape)
        lshape = tuple(_local(p))
        local_numel += int(torch.Size(lshape).numel())
        total_numel += int(torch.Size(gshape).numel())
        if lines is not None:
            lines.append(f"{name:62s} {str(list(gshape)):>22s} {str(list(lshape)):>22s}  {_placement(p, meta)}")
    return local_numel, total_numel


class _UnitFigures(NamedTuple):
    in_flight: int  # elements gathered at once beyond the kept units: a stage and the ones prefetched after it
    reduce_buffers: int  # bytes of the largest stage's gradient reduce buffers
    once_numel: int  # gathered once per micro-batch (the root and the head)
    kept_numel: int  # unsharded from forward to backward
    all_numel: int  # every unit's and every local expert's elements, unsharded
    experts_kept: bool  # the experts' compute copies live from forward to backward
    fused_numel: int  # experts updated by the fused pass (compute-dtype gradients)
    held_grads: int  # bytes of unsharded gradients held with gradient_sync last_micro_batch


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
    kept += list(local_experts.values())
    kept_numel = sum(_managed_numel(m, skip) for m in kept)
    kept_ids = {id(m) for m in kept}
    all_numel = sum(_managed_numel(m, skip) for _, m in units) + sum(
        _managed_numel(m, skip) for m in local_experts.values()
    )

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
        return _managed_numel(unit, skip) * (expert_reduce_bytes if id(unit) in expert_units else 4)

    def stage_grad_bytes(stage: Any) -> int:
        # (local experts reduce nothing: their gradients stay where backward adds them)
        return sum(grad_bytes(m) for _, m in stage.modules)

    reduce_buffers = max(stage_grad_bytes(stage) for stage in units.stages)  # the largest stage's, in backward
    # Experts outside FSDP updated by the fused pass keep their gradients in the compute dtype.
    fused_numel = sum(p.numel() for m in local_experts.values() for p in m.parameters())
    fused_numel = fused_numel if cfg.train.fuse_local_experts else 0

    # train.gradient_sync last_micro_batch: every FSDP unit holds its unsharded gradients until the step's last
    # backward reduces them, in the reduce dtype (FSDP2 accumulates in it), instead of its shard of them (counted
    # in the gradients): (n - 1) / n of them more over a shard group of n ranks, nothing on one rank (measured on
    # one H200: the same peak as every_micro_batch).
    def shards(unit: Any) -> int:
        return meshes.ep_fsdp_size if id(unit) in expert_units else meshes.world_size

    held_grads = sum(grad_bytes(m) * (shards(m) - 1) // shards(m) for _, m in units)
    return _UnitFigures(
        in_flight, reduce_buffers, once_numel, kept_numel, all_numel, experts_kept, fused_numel, held_grads
    )


def _expert_grad_bytes(cfg: JobConfig) -> int:
    """Bytes per element of the expert units' gradient reduce-scatter (``parallel.expert_reduce_dtype``)."""
    return 2 if cfg.parallel.expert_reduce_dtype == "bfloat16" else 4


def _managed_numel(unit: torch.nn.Module, skip: set[int]) -> int:
    """Unsharded elements of the parameters of ``unit`` and its submodules, except those of the modules in
    ``skip`` (other units, and expert modules outside FSDP): what one FSDP unit gathers."""
    total, stack = 0, [unit]
    while stack:
        m = stack.pop()
        total += sum(p.numel() for p in m.parameters(recurse=False))
        stack.extend(c for c in m.children() if id(c) not in skip)
    return total


def comm_estimate(
    cfg: JobConfig, mcfg: Any, world: int, per_node: int, elem: int, once_numel: int, *, uniform_routing: bool = True
) -> dict[tuple[str, str], float]:
    """Bytes per optimizer step per rank by ``(kind, link)`` for this job (see :mod:`moeshard.train.observe.comm`)."""
    from moeshard.train.observe.comm import estimate_comm_bytes

    reshard, expert_reshard = parallel_options(cfg).resharding(world)
    return estimate_comm_bytes(
        mcfg,
        world_size=world,
        ranks_per_node=per_node,
        ep_size=cfg.parallel.ep_size,
        tokens_per_rank=cfg.train.global_batch_size // world * cfg.data.seq_len,
        micro_batches=max(1, cfg.train.global_batch_size // world // cfg.train.micro_batch_size),
        compute_bytes=elem,
        reshard_after_forward=reshard,
        once_numel=once_numel,
        expert_reshard_after_forward=expert_reshard,
        expert_reduce_bytes=_expert_grad_bytes(cfg),
        activation_checkpointing=parallel_options(cfg).activation_checkpointing == "full",
        reduce_every_micro_batch=gradient_sync(cfg.train, world) == "every_micro_batch",
        uniform_routing=uniform_routing,
    )


def comm_estimate_lines(est: dict[tuple[str, str], float], bound: dict[tuple[str, str], float]) -> list[str]:
    """Bytes per optimizer step per rank by collective kind, and which of them cross nodes."""
    out = ["estimated communication per optimizer step per rank (bytes sent to peers; all-to-all for uniform routing):"]
    for (kind, link), b in sorted(est.items()):
        extra = f"   (at most {bound[(kind, link)] / 2**20:.1f} MiB)" if kind == "all_to_all" else ""
        out.append(f"  {kind:16s} {link:11s} {b / 2**20:12.1f} MiB{extra}")
    out.append("  all_reduce       (loss, token count, gradient norm: a few scalars per step)")
    return out
