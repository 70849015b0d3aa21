"""The regime search of ``moeshard-train plan``: where the estimate exceeds a GPU's memory, the first regime that fits
it (:func:`_fitting_regime`: activation checkpointing, micro-batch, EP size, nodes), and the smallest sequence-parallel
size whose regime holds the job's rows (:func:`_context_fit`). Each regime's estimate is ``plan_build.py``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeshard.train.commands.plan_build import _build, _Built, _memory_estimate
from moeshard.train.commands.plan_memory import GiB, MemoryEstimate
from moeshard.train.config import ConfigError, JobConfig, check_layout, config_from_dict, parallel_options


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
