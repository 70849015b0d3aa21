"""The parallel plan of an MoE model and applying its expert-parallel part.

A model describes how it is parallelised with a :class:`ParallelPlan`: FQN patterns of the expert parameters
(sharded on dim 0, the expert dimension, over the EP group) and FQN patterns of its FSDP units. ``apply_ep``
keeps this EP rank's slice of every expert parameter as a plain local ``nn.Parameter`` and returns what was done
(:class:`EPInfo`, keyed by FQN, so it stays true after FSDP2 replaces the parameter objects): the caller hands it
on, as an argument, to whatever needs it (FSDP, prefetch, checkpoint readers); nothing is left on the model for
another package to read. It also gives every expert module that routes through ``self.dispatch`` (the protocol: an expert module calls
``self.dispatch(x_TD, ids_TK, weights_TK, w_gate_up, w_down)``) the dispatcher of its EP group and options.

Pattern syntax: a pattern is a dotted FQN in which a segment that is exactly ``*`` matches any one segment
(never zero, never several, never a part of one), e.g. ``model.layers.*.mlp.experts.gate_up_proj`` matches
``model.layers.0.mlp.experts.gate_up_proj`` but not ``model.layers.0.1.mlp.experts.gate_up_proj``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle

from moeshard.ep._dispatch import ExpertDispatch, HostSyncHooks, make_dispatch
from moeshard.ep._options import EPOptions
from moeshard.ep._weight_grads import WeightGradTarget

__all__ = [
    "EPInfo",
    "EPParamMeta",
    "ParallelPlan",
    "apply_ep",
    "ep_group",
    "find_expert_modules",
    "fqn_matches",
    "is_expert_module",
]

# This package's own marks on the expert modules (read only by the functions below): plain attributes live in
# the module's __dict__, which FSDP2 keeps when it swaps the module's class.
_GROUP_ATTR = "_moeshard_ep_group"
_EXPERT_ATTR = "_moeshard_ep_expert_fqn"


def _check_pattern(pattern: str, what: str) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{what} pattern must be a non-empty string, got {pattern!r}")
    for seg in pattern.split("."):
        if not seg:
            raise ValueError(f"{what} pattern {pattern!r} has an empty segment (two dots or a dot at an end)")
        if "*" in seg and seg != "*":
            raise ValueError(
                f"{what} pattern {pattern!r}: '*' must be a whole segment (it matches exactly one dotted name "
                f"segment), got segment {seg!r}"
            )


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether ``fqn`` matches ``pattern``; a ``*`` segment matches exactly one dotted name segment."""
    p_segs, f_segs = pattern.split("."), fqn.split(".")
    return len(p_segs) == len(f_segs) and all(p == "*" or p == f for p, f in zip(p_segs, f_segs))


@dataclass(frozen=True)
class ParallelPlan:
    """How a model is parallelised, by FQN pattern (see the module docstring for the pattern syntax).

    Attributes:
        ep_plan: expert-parameter pattern → placement; only ``Shard(0)`` (the expert dimension) is accepted.
        fsdp_units: patterns of the modules that become their own FSDP unit on the global mesh, in forward
            order, e.g. ``("model.embed_tokens", "model.layers.*", "lm_head")``; the rest joins the root unit.
    """

    ep_plan: dict[str, Shard]
    fsdp_units: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.ep_plan, dict):
            raise ValueError(f"ep_plan must be a dict of FQN pattern -> Shard(0), got {type(self.ep_plan).__name__}")
        for pattern, placement in self.ep_plan.items():
            _check_pattern(pattern, "ep_plan")
            if not (isinstance(placement, Shard) and placement.dim == 0):
                raise ValueError(
                    f"ep_plan[{pattern!r}] is {placement!r}; expert parameters are sharded on the expert "
                    "dimension only: use Shard(0)"
                )
        if isinstance(self.fsdp_units, str) or not isinstance(self.fsdp_units, Iterable):
            raise ValueError(f"fsdp_units must be a tuple of FQN patterns, got {self.fsdp_units!r}")
        object.__setattr__(self, "fsdp_units", tuple(self.fsdp_units))
        for pattern in self.fsdp_units:
            _check_pattern(pattern, "fsdp_units")


@dataclass(frozen=True)
class EPParamMeta:
    """What EP did to one expert parameter.

    Attributes:
        fqn: the parameter's FQN relative to the model ``apply_ep`` was given.
        global_shape: shape of the full parameter (all experts).
        ep_size: EP degree; ep_rank: this rank's index in the EP group.
        expert_start, expert_end: the global experts this rank holds, ``[expert_start, expert_end)``; the local
            tensor is ``full[expert_start:expert_end]``.
    """

    fqn: str
    global_shape: tuple[int, ...]
    ep_size: int
    ep_rank: int
    expert_start: int
    expert_end: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this rank's slice."""
        return (self.expert_end - self.expert_start, *self.global_shape[1:])


@dataclass(frozen=True)
class EPInfo:
    """Expert parallelism as applied to one model.

    Attributes:
        ep_size, ep_rank: EP degree and this rank's index in the EP group.
        expert_modules: FQNs of the expert modules (parents of the matched parameters), in module order.
        params: expert-parameter FQN → :class:`EPParamMeta`.
        options: the :class:`EPOptions` of the dispatchers ``apply_ep`` installed.
        host_sync_hooks: the one :class:`HostSyncHooks` all those dispatchers share (see
            :meth:`add_host_sync_hook`).
        modules: the expert module objects, in the order of ``expert_modules`` (see :meth:`module_names`).
    """

    ep_size: int
    ep_rank: int
    expert_modules: tuple[str, ...]
    params: dict[str, EPParamMeta]
    options: EPOptions = EPOptions()
    host_sync_hooks: HostSyncHooks = field(default_factory=HostSyncHooks, compare=False, repr=False)
    modules: tuple[nn.Module, ...] = field(default=(), compare=False, repr=False)

    def add_host_sync_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` right before each EP layer's device→host sync (forward) in the dispatchers of this EP.

        With EP size > 1 each MoE layer's forward makes one sync (the exchange sizes) and runs the hooks right
        before it, once per layer; EP size 1 has no such sync and never runs them. At that point the host is about
        to wait for the device, so host work done there (e.g. issuing the next layer's FSDP all-gather, see
        ``moeshard.prefetch``) costs no device time. Hooks must not launch work the sync depends on or synchronise
        themselves.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return self.host_sync_hooks.add(hook)

    def routes(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of these expert modules and routes through a ``moeshard.ep`` dispatcher."""
        return any(m is module for m in self.modules) and isinstance(getattr(module, "dispatch", None), ExpertDispatch)

    def accumulate_weight_grads(self, module: nn.Module, target: WeightGradTarget | None) -> None:
        """Hand the weight gradients of expert ``module`` to ``target``: the hand-off between this EP and the owner
        of those gradients (``moeshard.fsdp_moe.shard_model`` for the experts it keeps out of FSDP).

        From now on the backward of ``module``'s dispatcher asks ``target(weight)`` for each expert weight and adds
        that pass's gradient into the buffer it returns (inside the grouped GEMM with the triton tier on CUDA), or
        returns the gradient to autograd where it returns None (see ``moeshard.ep.WeightGradTarget``). None undoes it.

        Raises:
            ValueError: ``module`` is not one of this EPInfo's expert modules, or it routes through no dispatcher.
        """
        if not any(m is module for m in self.modules):
            raise ValueError(
                f"{type(module).__name__} is not an expert module of this EPInfo: pass one of EPInfo.modules (the "
                "modules apply_ep gave a dispatcher)"
            )
        dispatch = getattr(module, "dispatch", None)
        if not isinstance(dispatch, ExpertDispatch):
            raise ValueError(
                f"expert module {type(module).__name__} has no moeshard.ep dispatcher (module.dispatch): its backward "
                "is its own, so its weight gradients cannot be handed to a target"
            )
        dispatch.accumulate_weight_grads(target)

    def __reduce__(self):
        # Pickled (sent to another process, saved): the metadata only, not the live hooks and modules.
        return EPInfo, (self.ep_size, self.ep_rank, self.expert_modules, self.params, self.options)

    def module_names(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(current FQN, module)`` of each expert module in ``model``, in module order, found by identity: a
        wrapper added after ``apply_ep`` (activation checkpointing, compile) that changed FQNs does not hide them.

        Raises:
            ValueError: an expert module is not in ``model`` (this EPInfo is of another model).
        """
        ids = {id(m) for m in self.modules}
        found = [(name, m) for name, m in model.named_modules() if id(m) in ids]
        if len(found) != len(self.modules):
            raise ValueError(
                f"{len(self.modules) - len(found)} of the {len(self.modules)} expert modules of this EPInfo are not "
                f"in this {type(model).__name__}: pass the EPInfo that apply_ep returned for this model"
            )
        return found


def _mesh_size_rank(ep_mesh: DeviceMesh | None) -> tuple[int, int, dist.ProcessGroup | None]:
    if ep_mesh is None:
        return 1, 0, None
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"ep_mesh must be the 1-D EP mesh, got a {ep_mesh.ndim}-D mesh {ep_mesh.mesh_dim_names}; "
            "pass meshes.ep (or meshes.expert['ep'])"
        )
    size = ep_mesh.size()
    if size == 1:
        return 1, 0, None
    return size, ep_mesh.get_local_rank(), ep_mesh.get_group()


def _parent_fqn(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def apply_ep(
    model: nn.Module, plan: ParallelPlan, ep_mesh: DeviceMesh | None, options: EPOptions | None = None
) -> EPInfo:
    """Shard the plan's expert parameters on dim 0 over ``ep_mesh``, keep only this rank's experts, install the
    EP dispatchers.

    Each matched parameter is replaced by a plain local ``nn.Parameter`` holding
    ``full[ep_rank * E_local:(ep_rank + 1) * E_local]`` (works on ``meta`` and on materialised models; a
    materialised slice is copied so the full tensor can be freed). The mesh is dropped: experts are never
    gathered. ``ep_mesh=None`` or of size 1 means EP size 1: metadata is recorded, nothing is sliced.
    Every expert module (the parent of matched parameters) that has a ``dispatch`` attribute gets
    ``module.dispatch = make_dispatch(global expert count, EP group or None, options, hooks)``, all dispatchers
    of this call sharing one :class:`HostSyncHooks` (see :func:`add_host_sync_hook`); for EP size 1 that is a
    ``LocalDispatch``. Apply EP before activation checkpointing, compile and FSDP, so FQNs are the model's own.

    Args:
        model: the model (its parameters must not be DTensors yet).
        plan: the model's plan; only ``ep_plan`` is used here.
        ep_mesh: the 1-D EP mesh (``ParallelMeshes.ep``), or None.
        options: the dispatchers' :class:`EPOptions`; None for ``EPOptions()``.

    Returns:
        The :class:`EPInfo`: pass it on (``shard_model(..., ep_info=)``, the prefetch schedule's host-sync hook,
        the checkpoint readers); nothing is recorded on ``model`` but a mark on each expert module.

    Raises:
        ValueError: EP already applied; a pattern matches no parameter; a matched parameter's dim 0 is not
            divisible by the EP size; a matched parameter is already a DTensor; ``options`` is not an
            EPOptions; the matched parameters of one module disagree on the number of experts.
    """
    if any(is_expert_module(m) for m in model.modules()):
        raise ValueError("apply_ep was already applied to this model; apply it once, before FSDP")
    options = EPOptions() if options is None else options
    if not isinstance(options, EPOptions):
        raise ValueError(f"options must be an EPOptions or None, got {type(options).__name__}")
    ep_size, ep_rank, group = _mesh_size_rank(ep_mesh)

    named = list(model.named_parameters())
    matched: dict[str, nn.Parameter] = {}
    for pattern in plan.ep_plan:
        hits = [(fqn, p) for fqn, p in named if fqn_matches(pattern, fqn)]
        if not hits:
            sample = ", ".join(fqn for fqn, _ in named[:6]) or "<none>"
            raise ValueError(
                f"ep_plan pattern {pattern!r} matches no parameter of {type(model).__name__} "
                f"(its parameters start with: {sample}); fix the pattern ('*' matches exactly one segment)"
            )
        matched.update(hits)
    matched = {fqn: p for fqn, p in named if fqn in matched}  # model order, not pattern order

    # Validate everything before changing anything, so a failed call leaves the model as it was.
    for fqn, param in matched.items():
        if isinstance(param, DTensor):
            raise ValueError(f"expert parameter {fqn} is already a DTensor: apply_ep must run before FSDP/TP")
        if param.dim() == 0 or param.shape[0] % ep_size != 0:
            dim0 = param.shape[0] if param.dim() else "none (a scalar)"
            raise ValueError(
                f"expert parameter {fqn} has dim 0 of size {dim0}, not divisible by the EP size {ep_size}; "
                f"choose an EP size that divides the number of experts"
            )
    num_experts: dict[str, int] = {}  # expert module -> global expert count
    for fqn, param in matched.items():
        parent = _parent_fqn(fqn)
        if num_experts.setdefault(parent, param.shape[0]) != param.shape[0]:
            raise ValueError(
                f"the expert parameters of {parent or 'the model'} disagree on the number of experts: {fqn} has "
                f"{param.shape[0]}, another {num_experts[parent]}"
            )

    metas: dict[str, EPParamMeta] = {}
    for fqn, param in matched.items():
        e_local = param.shape[0] // ep_size
        start, end = ep_rank * e_local, (ep_rank + 1) * e_local
        metas[fqn] = EPParamMeta(fqn, tuple(param.shape), ep_size, ep_rank, start, end)
        if ep_size > 1:
            with torch.no_grad():
                local = param.detach()[start:end]
                if local.device.type != "meta":
                    local = local.clone()
            owner = model.get_submodule(_parent_fqn(fqn))
            setattr(owner, fqn.rpartition(".")[2], nn.Parameter(local, requires_grad=param.requires_grad))

    hooks = HostSyncHooks()
    expert_modules = tuple(name for name, _ in model.named_modules() if name in num_experts)
    for name in expert_modules:
        module = model.get_submodule(name)
        setattr(module, _GROUP_ATTR, group)
        setattr(module, _EXPERT_ATTR, name)
        if hasattr(module, "dispatch"):
            module.dispatch = make_dispatch(num_experts[name], group, options, hooks)

    return EPInfo(
        ep_size=ep_size,
        ep_rank=ep_rank,
        expert_modules=expert_modules,
        params=metas,
        options=options,
        host_sync_hooks=hooks,
        modules=tuple(model.get_submodule(name) for name in expert_modules),
    )


def is_expert_module(module: nn.Module) -> bool:
    """Whether ``apply_ep`` marked ``module`` as an expert module."""
    return _EXPERT_ATTR in module.__dict__


def ep_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The EP process group attached to an expert module by :func:`apply_ep` (None for EP size 1 or no EP)."""
    return module.__dict__.get(_GROUP_ATTR)


def find_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(current FQN, module)`` for every expert module under ``model``, found by the mark ``apply_ep`` leaves.

    Unlike ``EPInfo.expert_modules`` this follows the modules themselves, so it still finds them after a
    wrapper (activation checkpointing, compile) changed their FQNs.
    """
    return [(name, m) for name, m in model.named_modules() if is_expert_module(m)]
