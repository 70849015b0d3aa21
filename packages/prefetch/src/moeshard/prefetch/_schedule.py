"""Computing and applying the forward/backward prefetch schedule over nested FSDP2 units.

A *stage* is one step of the forward pass: the embedding, one decoder layer, the head. A layer's stage holds
several FSDP units: the layer unit (attention, norms, router; on the global mesh) whose forward runs the stage,
and its expert unit(s) (on the ep_fsdp mesh), nested inside it — or the layer unit alone where the experts are
no FSDP unit (``moeshard.fsdp_moe`` with an ep_fsdp mesh of one rank). FSDP2 all-gathers a unit in its own
pre-forward, so without a schedule the expert all-gather of layer i starts only after layer i's attention,
which is too short to hide it. The schedule makes the pre-forward hook of layer i's unit issue the all-gathers
of every unit of layers i+1..i+depth, and its pre-backward hook those of layers i-1..i-depth.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["PrefetchSchedule", "StageLike", "StagePrefetch", "apply_schedule", "build_schedule", "stage_units"]


class StageLike(Protocol):
    """What the schedule needs of a stage (``moeshard.fsdp_moe.Stage`` fits)."""

    @property
    def name(self) -> str:
        """The stage's name (e.g. the FQN of its first module)."""
        ...

    @property
    def modules(self) -> Sequence[tuple[str, nn.Module]]:
        """``(name, FSDP module)`` pairs; the first is the unit whose forward runs the stage."""
        ...


@dataclass(frozen=True)
class StagePrefetch:
    """The prefetch lists of one stage.

    Attributes:
        name: the stage's name.
        unit: the unit whose hooks issue the prefetches (the stage's first module, whose forward runs the stage).
        units: every unit of the stage, in forward order.
        forward: units all-gathered from ``unit``'s pre-forward hook, in issue order.
        backward: units all-gathered from ``unit``'s pre-backward hook, in issue order.
    """

    name: str
    unit: str
    units: tuple[str, ...]
    forward: tuple[str, ...]
    backward: tuple[str, ...]


@dataclass(frozen=True)
class PrefetchSchedule:
    """Which units each stage prefetches; ``depth == 0`` is off (FSDP2's default prefetching).

    Attributes:
        depth: how many stages ahead (forward) and behind (backward) each stage prefetches.
        stages: one entry per stage, in forward order.
    """

    depth: int
    stages: tuple[StagePrefetch, ...]
    _modules: Mapping[str, nn.Module] = field(default_factory=dict, repr=False, compare=False)

    @property
    def enabled(self) -> bool:
        """Whether the schedule prefetches anything beyond FSDP2's default."""
        return self.depth > 0

    def module(self, unit: str) -> nn.Module:
        """The module of the unit named ``unit``."""
        try:
            return self._modules[unit]
        except KeyError:
            raise KeyError(f"no unit named {unit!r} in the schedule; units: {list(self._modules)}") from None

    def as_dict(self) -> dict[str, Any]:
        """The schedule as plain data (JSON-ready), for tests and logs."""
        return {
            "depth": self.depth,
            "enabled": self.enabled,
            "stages": [
                {
                    "name": s.name,
                    "unit": s.unit,
                    "units": list(s.units),
                    "forward": list(s.forward),
                    "backward": list(s.backward),
                }
                for s in self.stages
            ],
        }

    def describe(self) -> str:
        """A table of the units each stage prefetches in forward and backward."""
        if self.enabled:
            head = (
                f"prefetch schedule: depth {self.depth} (forward: the next {self.depth} stage(s); "
                f"backward: the previous {self.depth} stage(s))"
            )
        else:
            head = "prefetch schedule: off (FSDP2 default: each unit all-gathers in its own pre-forward/pre-backward)"
        rows = [("stage", "forward prefetch", "backward prefetch")]
        rows += [(s.name, ", ".join(s.forward) or "-", ", ".join(s.backward) or "-") for s in self.stages]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = [head] + [f"  {a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
        return "\n".join(lines)


def stage_units(stages: Sequence[StageLike]) -> list[tuple[str, nn.Module]]:
    """All ``(name, module)`` units of ``stages`` in forward order (e.g. for :func:`record_unshard_order`)."""
    return [(name, module) for stage in stages for name, module in stage.modules]


def build_schedule(stages: Sequence[StageLike], depth: int = 1) -> PrefetchSchedule:
    """Compute the prefetch schedule over ``stages``.

    Stage k's first unit prefetches, in forward, every unit of stages k+1..k+depth (layer unit first, then its
    expert units, the order their forwards all-gather them) and, in backward, every unit of stages k-1..k-depth.
    At the ends, the embedding prefetches layer 0 in forward and the head the last layer in backward.

    Args:
        stages: forward-ordered objects with ``.name`` and ``.modules`` (a sequence of ``(name, module)``, the first
            module being the one whose forward runs the stage), e.g. ``FSDPUnits.stages``.
        depth: stages prefetched ahead/behind; 1 by default, 2 overlaps more at the cost of memory for one more
            gathered layer, 0 is off (FSDP2's default).

    Returns:
        The schedule; apply it with :func:`apply_schedule`.

    Raises:
        ValueError: a negative depth, a stage without modules, or a unit name or module used twice.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an integer >= 0 (0 is off), got {depth!r}")
    modules: dict[str, nn.Module] = {}
    seen: dict[int, str] = {}
    names: list[tuple[str, ...]] = []
    for stage in stages:
        units = tuple(stage.modules)
        if not units:
            raise ValueError(f"stage {stage.name!r} has no modules")
        for unit_name, module in units:
            if unit_name in modules:
                raise ValueError(f"unit name {unit_name!r} appears twice (stage {stage.name!r})")
            if id(module) in seen:
                raise ValueError(f"unit {unit_name!r} is the same module as unit {seen[id(module)]!r}")
            modules[unit_name] = module
            seen[id(module)] = unit_name
        names.append(tuple(n for n, _ in units))
    n = len(names)
    entries = []
    for k, stage in enumerate(stages):
        ahead = [u for j in range(k + 1, min(k + depth, n - 1) + 1) for u in names[j]]
        behind = [u for j in range(k - 1, max(k - depth, 0) - 1, -1) for u in names[j]]
        entries.append(
            StagePrefetch(
                name=stage.name,
                unit=names[k][0],
                units=names[k],
                forward=tuple(ahead),
                backward=tuple(behind),
            )
        )
    return PrefetchSchedule(depth=depth, stages=tuple(entries), _modules=modules)


def apply_schedule(schedule: PrefetchSchedule) -> None:
    """Set each stage's prefetch lists on its first unit (``set_modules_to_{forward,backward}_prefetch``).

    Every stage's lists are set, empty ones included: an empty list is FSDP2's default, so applying an "off"
    schedule restores the defaults on a model that had another schedule applied. Expert units keep FSDP2's
    default backward prefetch; it only ever targets a unit the schedule already requested, so it does nothing.

    Raises:
        ValueError: a unit is not an ``FSDPModule`` (``fully_shard`` was not applied to it).
    """
    for unit, module in schedule._modules.items():
        if not isinstance(module, FSDPModule):
            raise ValueError(f"unit {unit!r} is a {type(module).__name__}, not an FSDPModule: fully_shard it first")
    for stage in schedule.stages:
        owner = schedule.module(stage.unit)
        assert isinstance(owner, FSDPModule)
        owner.set_modules_to_forward_prefetch([schedule.module(u) for u in stage.forward])
        owner.set_modules_to_backward_prefetch([schedule.module(u) for u in stage.backward])
