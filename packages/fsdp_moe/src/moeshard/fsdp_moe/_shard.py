"""Bottom-up, expert-aware FSDP2: experts on dim 1 over ep_fsdp, everything else on dim 0 over all ranks.

Order of ``fully_shard`` calls (FSDP2 groups a module's parameters minus those already grouped, so children
first): for each FSDP unit of the plan (deepest first), the expert modules inside it on ``meshes.ep_fsdp`` with
``Shard(1)``, then the unit itself on ``meshes.fsdp``; expert modules in no unit next; the root last.

Where ``ep_fsdp`` has one rank (EP size = world size) there is nothing to gather or reduce for the experts, so
they get no FSDP unit: their parameters become the same ``Shard(1)`` DTensors on ``ep_fsdp`` that FSDP2 would
make, cast to the compute dtype by a forward hook (see ``_local_experts``), and every ``fully_shard`` call above
them ignores them (``ignored_params``). :class:`LocalExpertAdamW` may later take their float32
values as its masters and keep the parameters in the compute dtype.

Gradient divide factor: both kinds of parameter are divided by the world size W (see ``_divide_factors``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from moeshard.ep import EPInfo, EPParamMeta, ParallelPlan, fqn_matches
from moeshard.fsdp_moe._local_experts import keep_experts_local, local_experts_state
from moeshard.fsdp_moe._one_rank import reduce_in_place_on_one_rank
from moeshard.fsdp_moe._torch_internals import fsdp_param_groups
from moeshard.meshes import ParallelMeshes

__all__ = ["FSDPUnits", "ShardingInfo", "Stage", "clean_fqn", "default_mp_policy", "get_sharding_info", "shard_model"]

EXPERT_DIM = 1  # experts are sharded on dim 0 by EP; FSDP takes dim 1 so ep x ep_fsdp need not equal E
_SHARDING_ATTR = "_moeshard_fsdp_moe"
# Name segments that wrappers (activation checkpointing, torch.compile) insert; EP metadata and DCP use FQNs
# without them.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_fqn(fqn: str) -> str:
    """``fqn`` without the segments wrappers insert (the model's own FQN, as EP metadata and DCP use)."""
    return ".".join(seg for seg in fqn.split(".") if seg not in _WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class Stage:
    """One step of the forward order: the unit whose forward runs it, then the expert units inside it.

    Attributes:
        name: FQN of the stage's first module (e.g. ``model.layers.3``).
        modules: ``(FQN, FSDP module)`` pairs; the first is the unit on the global mesh, the rest its experts
            (none where experts are kept out of FSDP: ``ep_fsdp`` of one rank).
        local_experts: FQNs of the expert modules inside the stage that are not FSDP units (``ep_fsdp`` of one
            rank: nothing to gather; their parameters are cast to the compute dtype in their own forward).
    """

    name: str
    modules: tuple[tuple[str, FSDPModule], ...]
    local_experts: tuple[str, ...] = ()


@dataclass
class FSDPUnits:
    """The FSDP units :func:`shard_model` created, in forward order, for prefetch schedules and inspection.

    Attributes:
        stages: the embedding stage first, one stage per decoder block (block unit, then its expert units), the
            head last; generally one stage per unit matched by the plan's ``fsdp_units``, in plan order.
        root: the model itself (holds whatever no unit claimed, e.g. the final norm).
        experts: ``(FQN, FSDP module)`` for every expert unit, in module order (empty where ``ep_fsdp`` has one
            rank: see ``local_experts``).
        local_experts: ``(FQN, module)`` for every expert module kept out of FSDP (``ep_fsdp`` of one rank), in
            module order; its parameters are ``Shard(1)`` DTensors on ``ep_fsdp`` all the same.
    """

    stages: list[Stage]
    root: FSDPModule
    experts: tuple[tuple[str, FSDPModule], ...] = field(default=())
    local_experts: tuple[tuple[str, nn.Module], ...] = field(default=())

    def __iter__(self) -> Iterator[tuple[str, FSDPModule]]:
        """Every unit once, in forward order, the root last."""
        for stage in self.stages:
            yield from stage.modules
        yield "", self.root

    def describe(self) -> str:
        """One line per stage: its units and their meshes."""
        lines = []
        in_stages = {fqn for stage in self.stages for fqn in stage.local_experts}
        for stage in self.stages:
            parts = [f"{fqn} [{_mesh_name(m)}]" for fqn, m in stage.modules]
            parts += [f"{fqn} [{_LOCAL}]" for fqn in stage.local_experts]
            lines.append(f"{stage.name}: " + ", ".join(parts))
        root = [f"{fqn} [{_LOCAL}]" for fqn, _ in self.local_experts if fqn not in in_stages]
        lines.append(f"<root>: [{_mesh_name(self.root)}]" + "".join(f", {part}" for part in root))
        return "\n".join(lines)


_LOCAL = "ep_fsdp x1, no FSDP"


@dataclass(frozen=True)
class ShardingInfo:
    """What :func:`shard_model` recorded on the model (read with :func:`get_sharding_info`).

    Attributes:
        meshes: the meshes the model was sharded on.
        expert_params: expert-parameter FQN → EP metadata (global shape, experts held).
    """

    meshes: ParallelMeshes
    expert_params: dict[str, EPParamMeta]


def _mesh_name(module: FSDPModule) -> str:
    groups = fsdp_param_groups(module)
    if not groups:
        return "no params"
    mesh = groups[0].mesh_info.mesh
    return f"{','.join(mesh.mesh_dim_names or ('?',))} x{mesh.size()}"


def default_mp_policy(device_type: str) -> MixedPrecisionPolicy:
    """bf16 parameters with fp32 gradient reduction on GPU; plain fp32 elsewhere (CPU tests, reference runs).

    Forward inputs are not cast (``cast_forward_inputs=False``): FSDP2's cast would round every floating-point
    argument of the root's forward to bf16, the loss's float32 divisor (``num_items_in_batch``) among them (16,383
    tokens become 16,384), and the models compute in their parameters' dtype from the embedding on anyway."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def get_sharding_info(model: nn.Module) -> ShardingInfo | None:
    """The :class:`ShardingInfo` left on ``model`` by :func:`shard_model`, or None."""
    return model.__dict__.get(_SHARDING_ATTR)


def _validate(model: nn.Module, meshes: ParallelMeshes) -> None:
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if meshes.world_size != world or meshes.rank != rank:
        raise ValueError(
            f"the meshes were built for rank {meshes.rank} of a world of {meshes.world_size}, but this process is "
            f"rank {rank} of {world}; build the meshes in this job with moeshard.meshes.build_meshes(ep_size=...)"
        )
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("the model already has FSDP applied; call shard_model once, on a model without FSDP")


def _ep_info(ep_info: EPInfo | None, meshes: ParallelMeshes, plan: ParallelPlan) -> EPInfo:
    if ep_info is None:
        if plan.ep_plan:
            raise ValueError(
                "shard_model: the plan's EP part was not applied: call ep_info = moeshard.ep.apply_ep(model, plan, "
                "meshes.ep if meshes.ep_size > 1 else None) first and pass shard_model(..., ep_info=ep_info)"
            )
        return EPInfo(ep_size=meshes.ep_size, ep_rank=meshes.ep_rank, expert_modules=(), params={})
    if not isinstance(ep_info, EPInfo):
        raise ValueError(f"ep_info must be the moeshard.ep.EPInfo apply_ep returned, got {type(ep_info).__name__}")
    info = ep_info
    if info.ep_size != meshes.ep_size or info.ep_rank != meshes.ep_rank:
        raise ValueError(
            f"EP was applied with EP size {info.ep_size} (EP rank {info.ep_rank}) but the meshes have EP size "
            f"{meshes.ep_size} (EP rank {meshes.ep_rank}); apply EP with the same meshes: apply_ep(model, plan, "
            "meshes.ep)"
        )
    return info


def _check_experts(model: nn.Module, info: EPInfo, meshes: ParallelMeshes) -> list[str]:
    """The expert modules' current FQNs, after checking every parameter they hold."""
    n = meshes.ep_fsdp_size
    # Found by identity, so wrappers added after apply_ep do not hide them.
    names = [name for name, _ in info.module_names(model)]
    for name in names:
        for pname, param in model.get_submodule(name).named_parameters():
            fqn = clean_fqn(f"{name}.{pname}")
            meta = info.params.get(fqn)
            if meta is None:
                raise ValueError(
                    f"expert module {name} holds {fqn}, which the EP plan does not shard; an expert module "
                    "must hold only expert parameters (its gradients are reduced over ep_fsdp only): add the "
                    "parameter to the plan's ep_plan or move it out of the expert module"
                )
            if param.dim() <= EXPERT_DIM or param.shape[EXPERT_DIM] % n != 0:
                size = param.shape[EXPERT_DIM] if param.dim() > EXPERT_DIM else "none"
                raise ValueError(
                    f"expert parameter {fqn} {tuple(param.shape)}: dim {EXPERT_DIM} (size {size}) is not divisible "
                    f"by the ep_fsdp size {n} (FSDP2 on torch {torch.__version__} shards a non-zero dim evenly "
                    f"only); choose ep_size so that world_size / ep_size divides {size}"
                )
    return names


def _match_units(model: nn.Module, plan: ParallelPlan, expert_names: set[str]) -> list[str]:
    names = [name for name, _ in model.named_modules() if name]
    units: list[str] = []
    for pattern in plan.fsdp_units:
        hits = [n for n in names if fqn_matches(pattern, n)]
        if not hits:
            raise ValueError(
                f"fsdp_units pattern {pattern!r} matches no module of {type(model).__name__}; fix the plan "
                "('*' matches exactly one dotted segment)"
            )
        for hit in hits:
            if hit in expert_names or any(hit.startswith(e + ".") for e in expert_names):
                raise ValueError(
                    f"fsdp_units pattern {pattern!r} matches {hit}, an expert module or inside one; expert "
                    "modules become their own units on the ep_fsdp mesh: keep them out of fsdp_units"
                )
            if hit not in units:
                units.append(hit)
    return units


def _innermost_unit(expert: str, units: list[str]) -> str | None:
    owners = [u for u in units if expert.startswith(u + ".")]
    return max(owners, key=len) if owners else None


def _divide_factors(module: FSDPModule, meshes: ParallelMeshes, mesh_size: int) -> None:
    # Every rank's loss is its share of a global mean (mean over the global batch = mean over ranks of the
    # per-rank means), so the wanted gradient is (1/W) * sum over all W ranks of the per-rank gradients.
    # Non-expert: FSDP reduce-scatters over all W ranks; dividing by W gives exactly that.
    # Expert: the EP all-to-all backward already summed, on the rank holding an expert, the gradients from the
    # tokens of all ep ranks; the reduce-scatter over ep_fsdp then sums over the remaining W/ep ranks. The sum
    # covers all W ranks once, so the divisor is W too, not the ep_fsdp size FSDP would use by default.
    # At W = 1 FSDP2's default (no factor) is the same and copies the gradients as they are; with a factor of 1 it
    # copies them through a division by 1 (one more pass over every float32 gradient).
    if meshes.world_size > 1:
        module.set_gradient_divide_factor(float(meshes.world_size))
    # gloo has no PREMUL_SUM (FSDP's way to apply a custom factor): reduce with SUM and scale separately. Only
    # where a collective runs: with a mesh of size 1, FSDP2 divides in its copy and would divide again after.
    # (Experts kept out of FSDP on a one-rank ep_fsdp mesh apply the same factor W in their cast's backward.)
    if mesh_size > 1 and dist.get_backend() == "gloo":
        module.set_force_sum_reduction_for_comms(True)
    # On one rank the "reduce-scatter" is FSDP2's copy of its input buffer into its output buffer: made a no-op.
    if mesh_size == 1:
        reduce_in_place_on_one_rank(module)


def shard_model(
    model: nn.Module,
    meshes: ParallelMeshes,
    *,
    ep_info: EPInfo | None = None,
    plan: ParallelPlan | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    offload_policy: OffloadPolicy | None = None,
    fsdp_experts_on_one_rank: bool = False,
    expert_reduce_dtype: torch.dtype | None = None,
    expert_reshard_after_forward: bool | None = None,
    compile: bool = False,
) -> FSDPUnits:
    """Apply FSDP2 bottom-up: experts on dim 1 over ``meshes.ep_fsdp``, units and root on dim 0 over ``meshes.fsdp``.

    Expert modules are the ones ``apply_ep`` recorded (parents of the plan's ``ep_plan`` parameters); units are
    the modules matched by the plan's ``fsdp_units``. Gradients of both are divided by the world size, so for a
    loss that is each rank's share of the global-batch mean they equal single-process gradients.

    Where ``meshes.ep_fsdp`` has one rank, expert modules get no FSDP unit (there is nothing to gather or reduce):
    their parameters become the ``Shard(1)`` DTensors on ``ep_fsdp`` that FSDP2 would make, in the master dtype,
    and a forward hook hands the module compute-dtype copies (``mp_policy.param_dtype``) whose backward casts the
    gradient back and divides it by the world size. They are listed in ``FSDPUnits.local_experts`` and
    ``Stage.local_experts``, not in the units; checkpoints, clipping and torch's AdamW treat them as before, and
    ``build_optimizer`` updates them with :class:`LocalExpertAdamW` (float32 masters in the
    optimizer, the parameters in the compute dtype).

    Args:
        model: the model with EP applied (``moeshard.ep.apply_ep(model, plan, meshes.ep)``, for EP size 1 too:
            it is how the expert parameters are known).
        meshes: from ``moeshard.meshes.build_meshes`` in this job.
        ep_info: what ``apply_ep`` returned for this model and these meshes; None only for a plan without an
            ``ep_plan`` (no experts). shard_model never applies EP itself.
        plan: the parallel plan; defaults to ``model.get_parallel_plan()``.
        mp_policy: FSDP2 mixed precision; defaults to :func:`default_mp_policy` of the meshes' device type.
        reshard_after_forward: passed to every unit, except the last unit in forward order (the head: backward
            starts there) and the expert units (``expert_reshard_after_forward``, if given; never on an ep_fsdp
            mesh of one rank: nothing to gather). The root keeps FSDP2's own root rule.
        offload_policy: passed to every unit (e.g. ``CPUOffloadPolicy()``); with CPU offloading experts stay FSDP
            units on a one-rank ep_fsdp mesh too (FSDP2 moves them to and from the device).
        fsdp_experts_on_one_rank: make expert modules FSDP units on a one-rank ep_fsdp mesh as well (slower, same
            numbers; for comparisons).
        expert_reduce_dtype: the dtype of the expert units' gradient reduce-scatter (``torch.float32`` or
            ``torch.bfloat16``; None: ``mp_policy.reduce_dtype``), the other units keep ``mp_policy``'s. With
            ``torch.bfloat16`` the reduce-scatter sends half the bytes and sums (and divides) in bfloat16; FSDP2
            then casts the result to the parameter's dtype, so ``.grad`` stays float32 beside float32 masters.
            Gradients accumulated unsharded across micro-batches (``set_requires_gradient_sync(False)``) are held
            in bfloat16 too. No effect on experts kept out of FSDP (nothing is reduced).
        expert_reshard_after_forward: for the expert units (None: ``reshard_after_forward``); False keeps each
            expert unit's gathered parameters from its forward to its backward: one all-gather per micro-batch
            instead of two, for the gathered experts' memory through the whole forward. Ignored on an ep_fsdp
            mesh of one rank (never resharded: nothing to gather).
        compile: ``torch.compile`` the cast-and-scale of the gradients of experts kept out of FSDP (one vectorised
            pass on CUDA instead of the eager broadcast multiply; the same numbers). Compiled on first use; a
            failed compile raises.

    Returns:
        The units in forward order (:class:`FSDPUnits`).

    Raises:
        ValueError: an EP plan and no ``ep_info`` (EP not applied); EP applied with other meshes; meshes from
            another world; an expert dim 1 not divisible by the ep_fsdp size; a non-expert parameter inside an
            expert module; a plan unit matching nothing or an expert module; FSDP already applied; an
            ``expert_reduce_dtype`` or ``expert_reshard_after_forward`` of another kind.
    """
    if expert_reduce_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(
            f"expert_reduce_dtype={expert_reduce_dtype!r} is not allowed: torch.float32, torch.bfloat16 or None"
        )
    if expert_reshard_after_forward is not None and not isinstance(expert_reshard_after_forward, bool):
        raise ValueError(
            f"expert_reshard_after_forward={expert_reshard_after_forward!r} is not allowed: True, False or None"
        )
    _validate(model, meshes)
    if plan is None:
        if not hasattr(model, "get_parallel_plan"):
            raise ValueError(f"{type(model).__name__} has no get_parallel_plan(); pass plan=ParallelPlan(...)")
        plan = model.get_parallel_plan()
    info = _ep_info(ep_info, meshes, plan)
    expert_names = _check_experts(model, info, meshes)
    units = _match_units(model, plan, set(expert_names))

    mp_policy = mp_policy or default_mp_policy(meshes.device_type)
    kwargs: dict = {"mp_policy": mp_policy, "reshard_after_forward": reshard_after_forward}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy

    def shard_dim1(_param: nn.Parameter) -> Shard:
        return Shard(EXPERT_DIM)

    experts_of: dict[str | None, list[str]] = {}
    for name in expert_names:
        experts_of.setdefault(_innermost_unit(name, units), []).append(name)

    sharded: dict[str, FSDPModule] = {}
    local = (
        meshes.ep_fsdp_size == 1 and not fsdp_experts_on_one_rank and not isinstance(offload_policy, CPUOffloadPolicy)
    )
    # Parameters of experts kept out of FSDP: every fully_shard call above them must leave them alone.
    ignored: set[nn.Parameter] = set()
    if local:
        for name in expert_names:
            module = model.get_submodule(name)
            ignored.update(
                keep_experts_local(
                    module, meshes.ep_fsdp, EXPERT_DIM, mp_policy, float(meshes.world_size), compile=compile
                )
            )
            if info.routes(module):
                # later micro-batches' expert gradients added into param.grad by the dispatcher's backward
                info.accumulate_weight_grads(module, local_experts_state(module))  # a target that can take factors
    ignore = {"ignored_params": ignored} if ignored else {}  # an empty set would still change FSDP2's module walk

    expert_kwargs = dict(kwargs)
    if expert_reduce_dtype is not None:
        expert_kwargs["mp_policy"] = dataclasses.replace(mp_policy, reduce_dtype=expert_reduce_dtype)
    if expert_reshard_after_forward is not None:
        expert_kwargs["reshard_after_forward"] = expert_reshard_after_forward
    if meshes.ep_fsdp_size == 1:
        expert_kwargs["reshard_after_forward"] = False

    def shard_experts(names: list[str]) -> None:
        if local:
            return
        for name in names:
            mod = fully_shard(
                model.get_submodule(name), mesh=meshes.ep_fsdp, shard_placement_fn=shard_dim1, **expert_kwargs
            )
            _divide_factors(mod, meshes, meshes.ep_fsdp_size)
            sharded[name] = mod

    # Deepest units first, so nested units are grouped before the units that contain them.
    for unit in sorted(units, key=lambda u: u.count("."), reverse=True):
        shard_experts(experts_of.get(unit, []))
        unit_kwargs = {**kwargs, "reshard_after_forward": False} if unit == units[-1] else kwargs
        mod = fully_shard(model.get_submodule(unit), mesh=meshes.fsdp, **unit_kwargs, **ignore)
        _divide_factors(mod, meshes, meshes.world_size)
        sharded[unit] = mod
    shard_experts(experts_of.get(None, []))
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    root = fully_shard(model, mesh=meshes.fsdp, **root_kwargs, **ignore)
    _divide_factors(root, meshes, meshes.world_size)

    def stage(unit: str) -> Stage:
        experts = experts_of.get(unit, [])
        if local:
            return Stage(unit, ((unit, sharded[unit]),), tuple(experts))
        return Stage(unit, ((unit, sharded[unit]), *((e, sharded[e]) for e in experts)))

    stages = [stage(u) for u in units]
    if not local:
        stages += [Stage(e, ((e, sharded[e]),)) for e in experts_of.get(None, [])]
    setattr(model, _SHARDING_ATTR, ShardingInfo(meshes=meshes, expert_params=dict(info.params)))
    return FSDPUnits(
        stages=stages,
        root=root,
        experts=tuple((e, sharded[e]) for e in expert_names if e in sharded),
        local_experts=tuple((e, model.get_submodule(e)) for e in expert_names) if local else (),
    )
