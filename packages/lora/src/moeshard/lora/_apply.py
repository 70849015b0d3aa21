"""Adding LoRA adapters to a model: which modules and tensors they target, their parameters, their forward.

The base keeps its names: a targeted linear module ``m`` gets the parameters ``m.lora_A [r, in]`` and
``m.lora_B [out, r]`` beside ``m.weight`` and a forward hook that adds ``s · x Aᵀ Bᵀ``; a targeted fused expert
tensor ``m.p [E, out, in]`` gets ``m.p_lora_A [E, r, in]`` and ``m.p_lora_B [E, out, r]`` beside it, which the
expert module's own grouped GEMMs apply (``moeshard.ep.LowRankDelta`` in the expert pass of every dispatcher, or
:func:`moeshard.lora.expert_lora_delta`), and the module gets the plain attribute ``lora_scaling`` (the scaling). So a base checkpoint loads into the adapted model unchanged, and sharding plans that
name ``m.p`` name its adapters by suffix. PEFT's names (``base_layer``, ``lora_A.weight``, ...) exist only in the
folder format (:mod:`moeshard.lora._peft`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moeshard.lora._options import LoraOptions

__all__ = [
    "ExpertAdapter",
    "LoraAdapters",
    "LoraTarget",
    "apply_lora",
    "merged_weights",
    "reset_adapters",
    "set_adapters",
]

LINEAR, EXPERTS = "linear", "experts"


@dataclass(frozen=True)
class LoraTarget:
    """One adapted tensor: the module that holds it, its name there, and what kind of tensor it is.

    ``nesting``: for an expert tensor, how many of the module's other targeted tensors PEFT wraps around it (PEFT
    wraps a module's targeted parameters one inside the other, in the order the module registers them, and the
    inner ones get ``base_layer.`` in their names); 0 for a linear module.
    """

    module: str
    param: str
    kind: str
    nesting: int = 0

    @property
    def base_name(self) -> str:
        """The base tensor's name in the model's state dict (``m.weight``, ``m.gate_up_proj``)."""
        return f"{self.module}.{self.param}"

    @property
    def a_name(self) -> str:
        """The adapter A's name in the model's state dict."""
        return f"{self.module}.lora_A" if self.kind == LINEAR else f"{self.module}.{self.param}_lora_A"

    @property
    def b_name(self) -> str:
        """The adapter B's name in the model's state dict."""
        return f"{self.module}.lora_B" if self.kind == LINEAR else f"{self.module}.{self.param}_lora_B"


@dataclass(frozen=True)
class ExpertAdapter:
    """The adapter of one fused expert tensor, for the expert module's grouped GEMMs: ``A [E, r, in]``,
    ``B [E, out, r]``, ``scaling``."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float


def _param_of(module: nn.Module, name: str) -> torch.Tensor:
    return module.get_parameter(name)


class LoraAdapters:
    """What :func:`apply_lora` added to a model: the options and the targets, in the model's module order.

    Holds no tensors: the adapters are parameters of the model (``model.get_parameter(t.a_name)``), so FSDP, EP
    plans, optimizers and DCP see them like any parameter.
    """

    def __init__(
        self,
        options: LoraOptions,
        targets: tuple[LoraTarget, ...],
        shapes: Mapping[str, tuple[int, ...]],
        handles: list,
    ):
        self.options = options
        self.targets = targets
        self.shapes = dict(shapes)  #: each adapter's shape by its name, as :func:`apply_lora` made it
        self._handles = handles

    @property
    def scaling(self) -> float:
        """The adapters' scaling (``options.scaling``)."""
        return self.options.scaling

    def names(self) -> list[str]:
        """The adapters' parameter names in the model, A then B per target."""
        return [n for t in self.targets for n in (t.a_name, t.b_name)]

    def parameters(self, model: nn.Module) -> Iterator[nn.Parameter]:
        """The adapters' parameters of ``model`` (what the optimizer trains)."""
        for name in self.names():
            yield model.get_parameter(name)

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The adapters' tensors by their names in the model (detached, not copied)."""
        return {name: model.get_parameter(name).detach() for name in self.names()}

    @torch.no_grad()
    def load_state_dict(self, model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` (as :meth:`state_dict` names them) into the model's adapters; every name is required."""
        missing = [n for n in self.names() if n not in tensors]
        if missing:
            raise ValueError(f"lora: the adapter tensors lack {missing[0]} ({len(missing)} missing)")
        for name in self.names():
            p, t = model.get_parameter(name), tensors[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"lora: {name} has shape {tuple(t.shape)}, the model's adapter {tuple(p.shape)}")
            p.copy_(t)

    def expert(self, model: nn.Module, module: str, param: str) -> ExpertAdapter | None:
        """The adapter of the fused expert tensor ``module.param``, or None where it has none."""
        for t in self.targets:
            if t.kind == EXPERTS and t.module == module and t.param == param:
                return ExpertAdapter(model.get_parameter(t.a_name), model.get_parameter(t.b_name), self.scaling)
        return None

    def remove_hooks(self) -> None:
        """Remove the linear modules' forward hooks (the parameters stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def describe(self) -> str:
        """One line: the options and how many tensors are adapted."""
        n_lin = sum(t.kind == LINEAR for t in self.targets)
        return f"{self.options.describe()} ({n_lin} linear modules, {len(self.targets) - n_lin} expert tensors)"


def _linear_hook(scaling: float, dropout: float = 0.0):
    # output + s · (x Aᵀ) Bᵀ with the second GEMM, its scaling and the sum in one addmm (one pass over the output
    # each way instead of three: a GEMM, a scaling, an add; backward's scaled gradients come from the GEMMs' alpha);
    # with dropout, PEFT's: on the adapter's input only, in train mode
    def hook(module: nn.Linear, args, output):
        x = args[0]
        if dropout:
            x = F.dropout(x, dropout, training=module.training)
        A, B = module.lora_A.to(x.dtype), module.lora_B.to(x.dtype)
        t = F.linear(x, A)
        out = torch.addmm(output.reshape(-1, output.shape[-1]), t.reshape(-1, t.shape[-1]), B.t(), alpha=scaling)
        return out.view(output.shape)

    return hook


def _refusal(module: nn.Module) -> str | None:
    """Why a linear module takes no adapter (its ``lora_refusal``, set on a module whose forward is more than its
    GEMM: an LM head that computes the loss from its weight), or None."""
    return getattr(module, "lora_refusal", None) or None


def _check_adaptable(name: str, module: nn.Module) -> None:
    """ValueError where a linear module says it takes no adapter (:func:`_refusal`)."""
    reason = _refusal(module)
    if reason:
        raise ValueError(f"lora targets {name} ({type(module).__name__}), which takes no adapter: {reason}")


# The leaf names PEFT takes for transformers 4's per-expert linears (see _peft.py's docstring): a folder names such
# linear targets in target_parameters, which PEFT wraps as parameters.
_PEFT_REMAPPED = frozenset({"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def _remapped(entry: str) -> bool:
    return entry.rpartition(".")[2] in _PEFT_REMAPPED


def _check_dropout(options: LoraOptions, targets: list[LoraTarget]) -> None:
    """ValueError where dropout meets a target PEFT wraps as a parameter (it refuses lora_dropout there)."""
    if not options.dropout:
        return
    wrapped = [t.base_name for t in targets if t.kind == EXPERTS or _remapped(t.module)]
    if wrapped:
        raise ValueError(
            f"lora.dropout {options.dropout:g} with {wrapped[0]} targeted: PEFT applies no dropout to tensors it "
            "wraps as parameters (fused experts, and linears named gate/up/down_proj, which it takes as experts' on "
            "MoE models); set lora.dropout=0, or target only other linear modules (q_proj, o_proj, ...)"
        )


ALL_LINEAR = "all-linear"
"""PEFT's shorthand ``target_modules``: every linear module but the output layer (the LM head)."""


def _all_linear(target_modules: tuple[str, ...] | str) -> bool:
    return isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR


def _module_matches(name: str, target_modules: tuple[str, ...] | str) -> bool:
    if _all_linear(target_modules):  # by name every module; by type the linear ones (see _find_targets)
        return True
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in target_modules)


def _output_layer(model: nn.Module) -> nn.Module | None:
    """The module ``all-linear`` leaves out, as PEFT does: the model's output embeddings (its LM head)."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


def _find_targets(model: nn.Module, options: LoraOptions) -> list[LoraTarget]:
    """The targets of ``options`` in ``model``, by PEFT's matching rules; one line per entry that matches nothing.
    ``target_modules="all-linear"`` takes every ``nn.Linear`` but the output layer and those that refuse an adapter
    (``lora_refusal``), as PEFT takes every linear module of the transformers model but its output embeddings."""
    tm, tp = options.target_modules, options.target_parameters
    targets: list[LoraTarget] = []
    hit_modules: set[str] = set()
    hit_params: set[str] = set()
    output_layer = _output_layer(model) if _all_linear(tm) else None
    for name, module in model.named_modules():
        if _all_linear(tm) and (not isinstance(module, nn.Linear) or module is output_layer or _refusal(module)):
            pass  # not a module all-linear takes (its parameters may still be targeted below)
        elif tm and name and _module_matches(name, tm):
            if not isinstance(module, nn.Linear):
                raise ValueError(
                    f"lora.target_modules matches {name} ({type(module).__name__}), which is not a linear module: "
                    "name linear modules there (q_proj, o_proj, ...) and fused expert tensors in target_parameters"
                )
            _check_adaptable(name, module)
            targets.append(LoraTarget(name, "weight", LINEAR))
            hit_modules.update([tm] if isinstance(tm, str) else [t for t in tm if name == t or name.endswith("." + t)])
        matched = []
        for pname, param in module.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            entries = [t for t in tp if key == t or key.endswith(f".{t}")]
            if not entries:
                continue
            if isinstance(module, nn.Linear) and pname == "weight":
                # PEFT wraps a linear module's weight named this way like the module itself (same names, same
                # delta), and save_adapter writes some linear targets so (see _peft.py: PEFT re-reads their names)
                if targets and targets[-1].module == name:
                    raise ValueError(
                        f"lora targets {name} twice (target_modules and target_parameters entry {entries[0]!r}): "
                        "name it once"
                    )
                _check_adaptable(name, module)
                targets.append(LoraTarget(name, "weight", LINEAR))
                hit_params.update(entries)
                continue
            if param.dim() != 3:
                raise ValueError(
                    f"lora.target_parameters matches {key} of shape {tuple(param.shape)}, neither a fused 3-D expert "
                    "tensor [experts, out, in] nor a linear module's weight: target modules with target_modules"
                )
            if not name:
                raise ValueError(
                    f"lora.target_parameters matches {key}, a parameter of the model itself, not of a module"
                )
            hit_params.update(entries)
            matched.append(pname)
        # PEFT wraps the module's targeted tensors in registration order, the first innermost
        targets += [LoraTarget(name, p, EXPERTS, nesting=len(matched) - 1 - i) for i, p in enumerate(matched)]
    if _all_linear(tm) and tm not in hit_modules:
        raise ValueError(
            f"lora.target_modules {tm!r}: the model has no linear module that takes an adapter (the LM head is left "
            "out); name modules, or target fused expert tensors in target_parameters"
        )
    for t in [tm] if isinstance(tm, str) else tm:
        if t not in hit_modules:
            raise ValueError(
                f"lora.target_modules entry {t!r} matches no module of the model; entries match module names "
                "(e.g. 'q_proj' matches 'model.layers.0.self_attn.q_proj')"
            )
    for t in tp:
        if t not in hit_params:
            raise ValueError(
                f"lora.target_parameters entry {t!r} matches no parameter of the model; entries match "
                "'module.parameter' names (e.g. 'mlp.experts.gate_up_proj')"
            )
    return targets


def apply_lora(
    model: nn.Module,
    options: LoraOptions,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    base_dtype: torch.dtype | None = None,
) -> LoraAdapters:
    """Add LoRA adapters to ``model`` in place and freeze everything else.

    Args:
        model: any module; targets are found by ``options.target_modules`` / ``target_parameters``.
        options: enabled options (``rank > 0``).
        seed: the adapters' initialisation seed (A: PEFT's kaiming-uniform with ``a = sqrt(5)``, per expert row
            block like PEFT's stacked ``[E·r, in]``; B: zeros, so the adapted model starts equal to the base).
        dtype: the adapters' dtype (float32: they are the trained masters; the forward casts them to the input's).
        base_dtype: the frozen base parameters' dtype (the compute dtype, e.g. bfloat16: a frozen weight needs no
            float32 master, so the base is held once, in the dtype the forward uses); None keeps theirs. Works on
            the meta device (before sharding: FSDP then shards the compute-dtype tensors).

    Returns:
        :class:`LoraAdapters`. The base parameters get ``requires_grad = False``.
    """
    if not options.enabled:
        raise ValueError("apply_lora: LoraOptions.rank is 0 (LoRA off); give a rank > 0")
    targets = _find_targets(model, options)
    _check_dropout(options, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    if base_dtype is not None:
        _cast_parameters(model, base_dtype)
    r, handles, shapes = options.rank, [], {}
    on_meta = all(model.get_parameter(t.base_name).is_meta for t in targets)  # no values to generate
    initial = _initial(model, targets, r, seed, meta=on_meta)
    for t, (A, B) in zip(targets, initial):
        module = model.get_submodule(t.module)
        base = _param_of(module, t.param)
        A, B = A.to(device=base.device, dtype=dtype), B.to(device=base.device, dtype=dtype)
        shapes[t.a_name], shapes[t.b_name] = tuple(A.shape), tuple(B.shape)
        module.register_parameter(t.a_name.rpartition(".")[2], nn.Parameter(A))
        module.register_parameter(t.b_name.rpartition(".")[2], nn.Parameter(B))
        if t.kind == LINEAR:
            handles.append(module.register_forward_hook(_linear_hook(options.scaling, options.dropout)))
        else:
            module.lora_scaling = options.scaling  # read by the expert module with its adapters (see the docstring)
    return LoraAdapters(options, tuple(targets), shapes, handles)


@torch.no_grad()
def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter of ``model`` as a new frozen parameter of ``dtype`` (buffers keep theirs:
    rotary tables and the like are computed in float32)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                setattr(module, name, nn.Parameter(p.to(dtype), requires_grad=False))


def _initial(
    model: nn.Module,
    targets,
    r: int,
    seed: int,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    *,
    meta: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each target's initial ``(A, B)``, float32 on the CPU, in the full (unsharded) shapes of the base tensors as
    ``shape`` gives them: one generator over the targets in order, so a sharded model gets the same values.
    ``meta``: the shapes only, on the meta device (a model built there has no values to give)."""
    gen = torch.Generator().manual_seed(seed)
    device = "meta" if meta else "cpu"
    for t in targets:
        shape = _global_shape(model, t, shapes)
        out_f, in_f = shape[-2], shape[-1]
        experts = shape[0] if t.kind == EXPERTS else 1
        A = torch.empty(experts * r, in_f, dtype=torch.float32, device=device)
        if not meta:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=gen)  # fan_in = in, as PEFT's nn.Linear(in, r·E)
        B = torch.zeros(experts, out_f, r, dtype=torch.float32, device=device)
        yield (A, B[0]) if t.kind == LINEAR else (A.reshape(experts, r, in_f), B)


def _global_shape(model: nn.Module, t: LoraTarget, shapes: Mapping[str, tuple[int, ...]] | None = None):
    if shapes is not None:  # the adapters' own shapes as apply_lora made them: A [E, r, in], B [E, out, r]
        a, b = shapes[t.a_name], shapes[t.b_name]
        return (a[0], b[1], a[2]) if t.kind == EXPERTS else (b[0], a[1])
    return tuple(model.get_parameter(t.base_name).shape)


@torch.no_grad()
def reset_adapters(model: nn.Module, adapters: LoraAdapters, seed: int = 0, *, ep_rank: int = 0) -> None:
    """Give the adapters of a sharded model their initial values, those :func:`apply_lora` gives with ``seed``.

    For the flow that builds the model on the meta device: ``apply_lora`` (its values are lost on meta), EP and
    FSDP, ``to_empty``, the base's weights loaded, then this. Each adapter's full tensor is generated on every rank
    alike, then cut to what the rank holds: this EP rank's experts (``ep_rank`` times the local expert count, on
    dim 0, for expert adapters whose dim 0 is smaller than the full one) and, for a DTensor (FSDP), its shard.
    """
    initial = _initial(model, adapters.targets, adapters.options.rank, seed, adapters.shapes)
    full = {
        name: value for t, pair in zip(adapters.targets, initial) for name, value in zip((t.a_name, t.b_name), pair)
    }
    set_adapters(model, adapters, full, ep_rank=ep_rank)


@torch.no_grad()
def set_adapters(
    model: nn.Module, adapters: LoraAdapters, tensors: Mapping[str, torch.Tensor], *, ep_rank: int = 0
) -> None:
    """Copy full (unsharded) adapter tensors into a model that may be sharded: each rank keeps what it holds.

    Args:
        tensors: every adapter by its name in the model, in its full shape (:func:`~moeshard.lora.load_adapter`'s
            result, or :meth:`LoraAdapters.state_dict` of an unsharded copy).
        ep_rank: this rank's EP rank: an expert adapter whose dim 0 is smaller than the full one holds experts
            ``ep_rank * local ... (ep_rank + 1) * local``; a DTensor (FSDP) keeps its shard of the rest.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    missing = [n for n in adapters.names() if n not in tensors]
    if missing:
        raise ValueError(f"lora: the adapter tensors lack {missing[0]} ({len(missing)} missing)")
    for t in adapters.targets:
        for name in (t.a_name, t.b_name):
            p, value = model.get_parameter(name), tensors[name]
            if tuple(value.shape) != adapters.shapes[name]:
                raise ValueError(
                    f"lora: {name} has shape {tuple(value.shape)}, the model's adapter {adapters.shapes[name]}"
                )
            if t.kind == EXPERTS and p.shape[0] != value.shape[0]:
                local = p.shape[0]
                if value.shape[0] % local or not 0 <= ep_rank < value.shape[0] // local:
                    raise ValueError(
                        f"lora: {name} holds {local} of {value.shape[0]} experts, which EP rank {ep_rank} "
                        "cannot hold; pass the rank's EP rank"
                    )
                value = value[ep_rank * local : (ep_rank + 1) * local]
            value = value.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(value.to_local())
            else:
                p.copy_(value)


@torch.no_grad()
def merged_weights(
    adapters: LoraAdapters, base: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The adapted base tensors with their adapters merged: ``W + s · B A`` (per expert for fused tensors).

    Args:
        adapters: what :func:`apply_lora` returned.
        base: the base tensors by their names in the model (``model.state_dict()``), full (not sharded).
        tensors: the adapters by their names in the model (:meth:`LoraAdapters.state_dict`, or a loaded folder).

    Returns:
        ``{base name: merged tensor}`` for every target, in the base tensor's dtype (the product is formed in
        float32); the other base tensors are not included.
    """
    out = {}
    for t in adapters.targets:
        W = base[t.base_name]
        A, B = tensors[t.a_name].float(), tensors[t.b_name].float()
        delta = (torch.bmm(B, A) if t.kind == EXPERTS else B @ A) * adapters.scaling
        out[t.base_name] = (W.float() + delta.to(W.device)).to(W.dtype)
    return out
