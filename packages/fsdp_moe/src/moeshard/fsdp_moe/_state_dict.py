"""EP-aware state dicts for ``torch.distributed.checkpoint`` (DCP): checkpoints independent of the layout.

Format: ``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {...}}, "param_groups": [...]}}`` with FQN keys
(torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``). Every tensor has its global shape:

- non-expert parameters and their optimizer state: FSDP2's ``Shard(0)`` DTensors on the ``fsdp`` mesh;
- expert parameters and their optimizer state: DTensors of the *full* shape ``[E, d1, ...]`` on the 2-D expert
  mesh ``("ep_fsdp", "ep")`` with placements ``(Shard(1), Shard(0))`` (EP on dim 0, ep_fsdp on dim 1), wrapping
  the FSDP local shard without a copy.

DCP stores each rank's pieces with their global offsets, so a checkpoint written with one EP size / world size
loads into any other: ``dcp.load`` reads exactly the slices the loading rank holds.

The optimizer may be a torch optimizer, a :class:`LocalExpertAdamW` or an
:class:`~moeshard.fsdp_moe.OptimizersContainer` of them. Experts updated by a LocalExpertAdamW are written as torch's
AdamW over their float32 parameters would write them: the model entry is the float32 master (not the compute-dtype
parameter), the optimizer entry ``{step, exp_avg, exp_avg_sq}``, and its parameter groups have AdamW's keys. So a
checkpoint loads across layouts *and* between fused and unfused expert updates (``build_optimizer(...,
fuse_local_experts=...)``). Parameter groups with equal hyper-parameters (all keys but ``params``, ``fused``,
``foreach``) are written as one group, as torch's AdamW over every parameter writes them; loading matches groups by
the FQNs they hold, as torch's ``set_optimizer_state_dict`` does. (A move between fused and unfused needs the same
distinct hyper-parameter groups on both sides: DCP asks for every ``param_groups`` entry of the loading side.)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from moeshard.ep import EPParamMeta
from moeshard.fsdp_moe._adamw_step import join_master_into, joined_master, local_tensor
from moeshard.fsdp_moe._local_adamw import LocalExpertAdamW
from moeshard.fsdp_moe._local_experts import dtensor_like, local_experts_state
from moeshard.fsdp_moe._optim import OptimizersContainer
from moeshard.fsdp_moe._shard import EXPERT_DIM, ShardingInfo, clean_fqn, get_sharding_info
from moeshard.meshes import ParallelMeshes

__all__ = [
    "MASTERS",
    "SplitMaster",
    "get_state_dict",
    "joined_masters",
    "load_checkpoint",
    "save_checkpoint",
    "set_state_dict",
]

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
# Placements on the expert mesh ("ep_fsdp", "ep"): ep_fsdp shards dim 1, ep shards dim 0 (the experts).
EXPERT_PLACEMENTS = (Shard(EXPERT_DIM), Shard(0))


MASTERS = ("joined", "split")
"""Values of :func:`get_state_dict`'s ``masters``."""


class SplitMaster:
    """A float32 master held split (a bf16 compute dtype, see :func:`split_master`), as a state dict entry.

    ``get_state_dict(..., masters="split")`` puts one where the float32 master would be, so that whatever copies
    the state (``moeshard.checkpoint.Stager``) joins the masters one tensor at a time, where ``"joined"`` makes all
    of them at once: 4 bytes per expert parameter on the device while the dict lives (for a background save, while
    the next steps run).

    Attributes:
        hi: the bf16 parameter (the live tensor; a DTensor of the entry's global shape for experts).
        lo: the int16 low halves, laid out like ``hi``.
    """

    __slots__ = ("hi", "lo")

    def __init__(self, hi: torch.Tensor, lo: torch.Tensor) -> None:
        if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16 or hi.shape != lo.shape or type(hi) is not type(lo):
            raise ValueError(
                f"SplitMaster: hi must be bfloat16 and lo int16 of the same shape and kind, got {type(hi).__name__} "
                f"{hi.dtype} {tuple(hi.shape)} and {type(lo).__name__} {lo.dtype} {tuple(lo.shape)}"
            )
        self.hi, self.lo = hi, lo

    @property
    def shape(self) -> torch.Size:
        """The master's (global) shape."""
        return self.hi.shape

    @property
    def dtype(self) -> torch.dtype:
        """torch.float32: the master's dtype, whatever the halves'."""
        return torch.float32

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's piece (the halves' local tensors)."""
        return local_tensor(self.hi).shape

    def join(self) -> torch.Tensor:
        """The float32 master, laid out like :attr:`hi` (a new tensor)."""
        joined = joined_master(local_tensor(self.hi), local_tensor(self.lo))
        return dtensor_like(joined, self.hi) if isinstance(self.hi, DTensor) else joined

    def join_into(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the master written into ``out`` (float32, :attr:`local_shape`, on the halves'
        device), without temporaries. Returns ``out``."""
        return join_master_into(local_tensor(self.hi), local_tensor(self.lo), out)

    def __repr__(self) -> str:
        return f"SplitMaster(shape={tuple(self.shape)}, local_shape={tuple(self.local_shape)})"

    def __reduce__(self):
        # DCP writes a value that is not a tensor by pickling it: it would store this object, not the master.
        raise TypeError(
            "a SplitMaster is not a checkpoint value: join the masters first (joined_masters(state), or "
            "get_state_dict(..., masters='joined')), or save through moeshard.checkpoint's Stager"
        )


def joined_masters(state: Any) -> Any:
    """``state`` (a nested dict / list) with every :class:`SplitMaster` joined (:meth:`SplitMaster.join`); the
    rest as it is (containers rebuilt, tensors not copied)."""
    if isinstance(state, SplitMaster):
        return state.join()
    if isinstance(state, dict):
        return {k: joined_masters(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        out = [joined_masters(v) for v in state]
        return tuple(out) if isinstance(state, tuple) else out
    return state


def _info(model: nn.Module) -> ShardingInfo:
    info = get_sharding_info(model)
    if info is None:
        raise ValueError("the model was not sharded with moeshard.fsdp_moe.shard_model; shard it first")
    return info


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _to_global(t: DTensor, meta: EPParamMeta, meshes: ParallelMeshes) -> DTensor:
    """Re-label FSDP's ``Shard(1)`` shard on ep_fsdp as a piece of the full expert tensor (no copy)."""
    local = t.to_local()
    shape = tuple(meta.global_shape)
    n = meshes.ep_fsdp_size
    # Even sharding on dim 1 is checked by shard_model, so the chunk layouts of FSDP and DTensor agree.
    expected = (meta.expert_end - meta.expert_start, shape[EXPERT_DIM] // n, *shape[2:])
    assert tuple(local.shape) == expected, (meta.fqn, tuple(local.shape), expected)
    return DTensor.from_local(
        local,
        meshes.expert,
        EXPERT_PLACEMENTS,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_stride(shape),
    )


def _to_fsdp(value: Any, like: DTensor, meta: EPParamMeta, meshes: ParallelMeshes) -> DTensor:
    """The inverse of :func:`_to_global`: the local piece as a DTensor shaped like FSDP's parameter ``like``."""
    if isinstance(value, DTensor):
        local = value.to_local()
    elif isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(meta.global_shape):
        # A full tensor (e.g. from a consolidated checkpoint): take this rank's experts and dim-1 chunk.
        local = value[meta.expert_start : meta.expert_end].chunk(meshes.ep_fsdp_size, dim=EXPERT_DIM)
        local = local[meshes.ep_fsdp_rank].contiguous()
    else:
        raise ValueError(f"{meta.fqn}: expected a DTensor or a tensor of shape {meta.global_shape}, got {value!r}")
    if tuple(local.shape) != tuple(like.to_local().shape):
        raise ValueError(
            f"{meta.fqn}: the loaded piece has shape {tuple(local.shape)}, this rank holds "
            f"{tuple(like.to_local().shape)}; load with dcp.load into a state dict from get_state_dict"
        )
    return dtensor_like(local.to(like.device), like)


def _children(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, OptimizersContainer):
        return list(optimizer.optimizers)
    return [optimizer]


def _masters(model: nn.Module, children: list[torch.optim.Optimizer]) -> list[LocalExpertAdamW]:
    """The LocalExpertAdamW among ``children``, after checking that they hold every master of ``model``."""
    fused = [o for o in children if isinstance(o, LocalExpertAdamW)]
    held = {id(p) for o in fused for g in o.param_groups for p in g["params"]}
    for name, module in model.named_modules():
        st = local_experts_state(module)
        if st is None:
            continue
        for pname in st.in_compute_dtype:
            if id(st.params[pname]) not in held:
                raise ValueError(
                    f"{clean_fqn(f'{name}.{pname}')} is in the compute dtype: its float32 master lives in a "
                    "LocalExpertAdamW; pass that optimizer (or the OptimizersContainer holding it)"
                )
    return fused


# Group keys that choose an implementation, not the update: groups differing only there are one group.
_IMPLEMENTATION_KEYS = frozenset({"params", "fused", "foreach"})


def _merge_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Groups with equal hyper-parameters as one group (FQNs concatenated), in order of first appearance.

    DCP stores ``param_groups`` entry by entry (``optimizer.param_groups.0.lr``, ...) and a load asks for every
    entry of the loading side: the container's per-optimizer groups would not load from the one group of torch's
    AdamW over every parameter, or the other way round. Merged, both write the same entries.
    """
    merged: list[dict[str, Any]] = []
    for group in groups:
        hyper = {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}
        for m in merged:
            if {k: v for k, v in m.items() if k not in _IMPLEMENTATION_KEYS} == hyper:
                m["params"] = [*m["params"], *group["params"]]
                break
        else:
            merged.append(dict(group))
    return merged


def _fused_params(opt: LocalExpertAdamW):
    for group in opt.param_groups:
        for p in group["params"]:
            yield opt.fqn(p), p


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, masters: str = "joined"
) -> dict[str, Any]:
    """A DCP-ready state dict of a model sharded by ``shard_model`` (and its optimizer), experts in global shape.

    ``optimizer``: a torch optimizer, a ``LocalExpertAdamW`` or an ``OptimizersContainer``; required where the
    model's local experts are updated by a LocalExpertAdamW (it holds their float32 weights). The tensors alias the
    live parameters, masters and optimizer state (nothing is copied), except the masters a LocalExpertAdamW holds
    split (a bf16 compute dtype). ``masters="joined"`` (the default) joins those into new float32 tensors
    (``LocalExpertAdamW.master``: 4 bytes per expert parameter on the device while the dict lives); ``dcp.load``
    into this dict writes the rest in place, and :func:`set_state_dict` after it splits those masters back.
    ``masters="split"`` puts a :class:`SplitMaster` there instead (its halves alias the live tensors): for a saver
    that joins them one at a time (``moeshard.checkpoint``'s ``Stager``, or :func:`joined_masters` first); DCP
    itself takes tensors only.

    Returns:
        ``{"model": ..., "optimizer": ...}`` (no ``"optimizer"`` key without an optimizer).

    Raises:
        ValueError: ``masters`` not in :data:`MASTERS`.
    """
    if masters not in MASTERS:
        raise ValueError(f"get_state_dict: masters={masters!r} is not one of {MASTERS}")
    info = _info(model)
    children = _children(optimizer)
    fused = _masters(model, children)
    msd = get_model_state_dict(model)
    for opt in fused:
        for fqn, p in _fused_params(opt):
            low = opt.state[p].get("master_low")
            if masters == "split" and low is not None:
                hi = p.detach()
                low = dtensor_like(local_tensor(low), hi) if isinstance(hi, DTensor) else low
                meta = info.expert_params.get(fqn)
                if meta is not None:
                    hi, low = _to_global(hi, meta, info.meshes), _to_global(low, meta, info.meshes)
                msd[fqn] = SplitMaster(hi, low)
            else:
                msd[fqn] = opt.master(p)
    for fqn, meta in info.expert_params.items():
        if not isinstance(msd[fqn], SplitMaster):
            msd[fqn] = _to_global(msd[fqn], meta, info.meshes)
    out: dict[str, Any] = {MODEL_KEY: msd}
    if optimizer is None:
        return out
    osd: dict[str, Any] = {"state": {}, "param_groups": []}
    groups: list[dict[str, Any]] = []
    # torch's optimizers first: a merged group takes its implementation flags (fused, foreach) from them, as the
    # unfused job's single AdamW would have written them.
    for opt in sorted(children, key=lambda o: isinstance(o, LocalExpertAdamW)):
        if isinstance(opt, LocalExpertAdamW):
            for group in opt.param_groups:
                groups.append({**group, "params": [opt.fqn(p) for p in group["params"]]})
            for fqn, p in _fused_params(opt):
                state = opt.state[p]
                osd["state"][fqn] = {k: state[k] for k in ("step", "exp_avg", "exp_avg_sq")}
        else:
            part = get_optimizer_state_dict(model, opt)
            osd["state"].update(part["state"])
            groups += part["param_groups"]
    osd["param_groups"] = _merge_groups(groups)
    for fqn, state in osd["state"].items():
        meta = info.expert_params.get(fqn)
        if meta is None:
            continue
        # A new dict: ``state`` is the optimizer's own per-parameter dict, which must keep FSDP's DTensors.
        # Per-element state (exp_avg, ...) is sharded like the parameter; scalars (step) stay as they are.
        osd["state"][fqn] = {
            key: _to_global(value, meta, info.meshes)
            if isinstance(value, DTensor) and value.dim() > EXPERT_DIM
            else value
            for key, value in state.items()
        }
    out[OPTIMIZER_KEY] = osd
    return out


def set_state_dict(
    model: nn.Module, state_dict: dict[str, Any], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a state dict in the format of :func:`get_state_dict` (typically filled by ``dcp.load``).

    Expert entries may be global-shape DTensors (any layout's) or full plain tensors; each rank keeps its slice.
    ``optimizer`` as for :func:`get_state_dict`; the experts a LocalExpertAdamW updates take their masters from the
    model entries and their parameters are rewritten from them.
    """
    info = _info(model)
    children = _children(optimizer)
    _masters(model, children)  # refuses a model whose masters the optimizer does not hold
    params = {clean_fqn(n): p for n, p in model.named_parameters()}
    msd = dict(state_dict[MODEL_KEY])
    for fqn, meta in info.expert_params.items():
        if fqn in msd:
            msd[fqn] = _to_fsdp(msd[fqn], params[fqn], meta, info.meshes)
    set_model_state_dict(model, msd)  # (a fused expert's float32 entry is cast into its parameter here)
    if optimizer is None:
        return
    if OPTIMIZER_KEY not in state_dict:
        raise ValueError("the state dict has no optimizer entry; save it with get_state_dict(model, optimizer)")
    osd = state_dict[OPTIMIZER_KEY]
    state = {}
    for fqn, entry in osd["state"].items():
        meta = info.expert_params.get(fqn)
        if meta is not None:
            entry = {
                k: _to_fsdp(v, params[fqn], meta, info.meshes)
                if isinstance(v, torch.Tensor) and v.dim() > EXPERT_DIM
                else v
                for k, v in entry.items()
            }
        state[fqn] = entry
    for opt in children:
        if not isinstance(opt, LocalExpertAdamW):
            set_optimizer_state_dict(model, opt, {"state": state, "param_groups": osd["param_groups"]})
            continue
        for group in opt.param_groups:
            # Hyper-parameters from the saved group holding this group's first parameter (torch's rule).
            first = opt.fqn(group["params"][0]) if group["params"] else None
            saved = next((g for g in osd["param_groups"] if first in g["params"]), None)
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k != "params"})
        for fqn, p in _fused_params(opt):
            if fqn not in state:
                raise RuntimeError(f"missing optimizer state for parameter '{fqn}' in the checkpoint")
            if fqn not in msd:
                raise RuntimeError(f"missing model entry (the float32 weight) for parameter '{fqn}' in the checkpoint")
            opt.load_param_state(p, {**state[fqn], "master": msd[fqn]})


def save_checkpoint(checkpoint_dir: str | os.PathLike, model: nn.Module, optimizer=None) -> None:
    """``dcp.save`` of :func:`get_state_dict` into ``checkpoint_dir`` (every rank calls it)."""
    dcp.save(get_state_dict(model, optimizer), checkpoint_id=os.fspath(checkpoint_dir))


def load_checkpoint(checkpoint_dir: str | os.PathLike, model: nn.Module, optimizer=None) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` under any EP size / world size (every rank calls it)."""
    state_dict = get_state_dict(model, optimizer)
    dcp.load(state_dict, checkpoint_id=os.fspath(checkpoint_dir))
    set_state_dict(model, state_dict, optimizer)
