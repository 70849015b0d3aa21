"""Several optimizers as one: :class:`OnePassAdamW` (or torch's AdamW) for the parameters FSDP2 manages,
:class:`LocalExpertAdamW` for the local experts.

:class:`OptimizersContainer` is a ``torch.optim.Optimizer`` whose ``param_groups`` are its children's group dicts
(so an LR scheduler drives all of them), with one ``step()``, ``zero_grad()``, ``state_dict()`` /
``load_state_dict()`` and a ``clip_grad_norm_`` that owns the order clip → step → zero_grad:

- ``clip_grad_norm_`` asks each child for its gradients' local norms (``param.grad`` of torch's optimizers, split
  by mesh as ``moeshard.fsdp_moe.get_total_norm`` does; :meth:`LocalExpertAdamW.grad_norms` for the local
  experts), reduces them in one all-reduce (a device tensor, no host sync) and applies the coefficient: in place
  for torch's for-loop / foreach optimizers; for torch's fused Adam / AdamW, OnePassAdamW and LocalExpertAdamW it
  is kept and applied inside the next ``step()`` (``grad_scale`` of torch's fused kernel; ``grad_mult`` of the
  one-pass updates), which saves a pass over the gradients. Until that step those gradients hold their unclipped
  values (torch's fused kernel stores the clipped ones back as it steps; the one-pass updates leave them).
- The kept coefficient belongs to the gradients it was computed from: gradients must not change between
  ``clip_grad_norm_`` and ``step()`` (nothing checks it). ``zero_grad()`` drops it; a second clip before the step
  sees the first one applied, as an in-place clip would.
- ``step()`` steps the children in order (``build_optimizer`` puts the local experts first: their update is a few
  long device passes with little host work, so the device works on them while the host runs torch's step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeshard.fsdp_moe._deferral import ExpertGradOptions
from moeshard.fsdp_moe._local_adamw import LocalExpertAdamW, local_expert_params
from moeshard.fsdp_moe._norm import (
    check_norm_type,
    local_norms,
    multiply_grads_,
    reduce_norms,
    split_grads,
)
from moeshard.fsdp_moe._one_pass_adamw import OnePassAdamW

__all__ = ["OptimizersContainer", "build_optimizer"]


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _takes_grad_mult(optimizer: torch.optim.Optimizer) -> bool:
    """Ours: ``step(grad_mult=coef)`` multiplies every gradient by the clip coefficient as it reads it."""
    return isinstance(optimizer, LocalExpertAdamW | OnePassAdamW)


def _applies_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused Adam / AdamW: its step divides every gradient by ``optimizer.grad_scale`` as it reads it."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )


class OptimizersContainer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters as one ``torch.optim.Optimizer``, with cross-mesh clipping.

    See the module docstring for the contract.

    Args:
        optimizers: the children, stepped in this order; no parameter in two of them.

    Attributes:
        optimizers: the children (a tuple).
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        optimizers = tuple(optimizers)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("OptimizersContainer takes a non-empty sequence of torch.optim.Optimizer")
        if any(isinstance(o, OptimizersContainer) for o in optimizers):
            raise TypeError("OptimizersContainer: give the optimizers of a container, not the container itself")
        seen: set[int] = set()
        for o in optimizers:
            ids = {id(p) for g in o.param_groups for p in g["params"]}
            if ids & seen:
                raise ValueError("OptimizersContainer: a parameter is in two of the optimizers; each steps its own")
            seen |= ids
        self.optimizers = optimizers
        # Not Optimizer.__init__ (it would make groups of its own): the attributes its hooks and methods use.
        self.defaults: dict[str, Any] = {}
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._clip_coefs: list[torch.Tensor | None] = [None] * len(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The children's parameter groups, in order: the same dict objects (what a scheduler changes, changes
        them)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        """Every child's per-parameter state (a merged view; write to a child's ``state``)."""
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("OptimizersContainer: add parameter groups to one of its optimizers (container.optimizers)")

    def __repr__(self) -> str:
        return f"OptimizersContainer({', '.join(type(o).__name__ for o in self.optimizers)})"

    # ---- gradients ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def get_total_norm(self, norm_type: float = 2.0, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The p-norm of every child's gradients as if the model lived in one process (a coefficient kept from an
        earlier clip included), equal on every rank: one all-reduce, a float32 device tensor, no host sync.

        Args:
            norm_type: p of the p-norm, ``float("inf")`` for the max norm.
            group: the process group spanning the world; defaults to the default group.
        """
        norm_type = check_norm_type(norm_type)
        sharded: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        for opt, coef in zip(self.optimizers, self._clip_coefs, strict=True):
            if isinstance(opt, LocalExpertAdamW):
                own, rep = opt.grad_norms(norm_type), []  # local experts: pieces no other rank holds
            else:
                s, r = split_grads(_grads(opt), group)
                own, rep = local_norms(s, norm_type), local_norms(r, norm_type)
            if coef is not None:
                own = [n * coef.to(n.device) for n in own]
                rep = [n * coef.to(n.device) for n in rep]
            sharded += own
            replicated += rep
        return reduce_norms(sharded, replicated, norm_type, group=group)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """Clip every child's gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` in one process.

        The coefficient ``min(1, max_norm / (total_norm + 1e-6))`` is applied in place, or kept for the next
        ``step()`` where a child applies it as it reads the gradients (torch's fused Adam / AdamW, OnePassAdamW,
        LocalExpertAdamW): gradients must not change between this call and ``step()``.

        Args:
            max_norm: the largest allowed total norm.
            norm_type: p of the p-norm (``float("inf")`` for the max norm).
            error_if_nonfinite: raise ``RuntimeError`` when the total norm is nan or inf (reads it on the host).
            group: the process group spanning the world; defaults to the default group.

        Returns:
            The total norm before clipping (float32 scalar tensor, equal on every rank).
        """
        total = self.get_total_norm(norm_type, group=group)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); pass "
                "error_if_nonfinite=False to clip anyway"
            )
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for i, opt in enumerate(self.optimizers):
            if _takes_grad_mult(opt) or _applies_grad_scale(opt):
                if getattr(opt, "grad_scale", None) is not None or getattr(opt, "found_inf", None) is not None:
                    raise ValueError(
                        f"OptimizersContainer.clip_grad_norm_: the {type(opt).__name__} has a grad_scale or "
                        "found_inf set by other code (torch.amp.GradScaler?); the clip coefficient would meet it in "
                        "its step: unscale and clip with moeshard.fsdp_moe.clip_grad_norm_ on the parameters there"
                    )
                kept = self._clip_coefs[i]
                self._clip_coefs[i] = clip_coef.clone() if kept is None else kept * clip_coef.to(kept.device)
            else:
                multiply_grads_(_grads(opt), clip_coef)
        return total

    # ---- the optimizer protocol -----------------------------------------------------------------------------------

    @torch.optim.Optimizer.profile_hook_step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step every child in order, applying a clip coefficient kept by :meth:`clip_grad_norm_` (then dropped).

        Args:
            closure: re-evaluates the model and returns the loss; called once, before the children step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coefs, self._clip_coefs = self._clip_coefs, [None] * len(self.optimizers)
        for opt, coef in zip(self.optimizers, coefs, strict=True):
            if _takes_grad_mult(opt):
                opt.step(grad_mult=coef)
            elif coef is not None:
                _step_with_grad_scale(opt, coef)
            else:
                opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every child's ``zero_grad``; a clip coefficient kept for the next step is dropped."""
        self._clip_coefs = [None] * len(self.optimizers)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's format, as one optimizer over every child's groups in order would give it: ``state`` keyed by
        the parameter's position across all groups, ``param_groups`` the children's in order. (Checkpoints that
        load under other layouts: :func:`moeshard.fsdp_moe.save_checkpoint`.)"""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({k + offset: v for k, v in sd["state"].items()})
            groups += [{**g, "params": [k + offset for k in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of a container with the same children and groups."""
        groups = state_dict["param_groups"]
        counts = [len(o.param_groups) for o in self.optimizers]
        if len(groups) != sum(counts):
            raise ValueError(
                f"OptimizersContainer.load_state_dict: {len(groups)} parameter groups in the state dict, "
                f"{sum(counts)} in the children ({', '.join(map(str, counts))})"
            )
        self._clip_coefs = [None] * len(self.optimizers)
        at, offset = 0, 0
        for opt, n in zip(self.optimizers, counts, strict=True):
            mine = groups[at : at + n]
            keys = [k for g in mine for k in g["params"]]
            opt.load_state_dict(
                {
                    "state": {k - offset: state_dict["state"][k] for k in keys if k in state_dict["state"]},
                    "param_groups": [{**g, "params": [k - offset for k in g["params"]]} for g in mine],
                }
            )
            at += n
            offset += len(keys)


def _step_with_grad_scale(opt: torch.optim.Optimizer, coef: torch.Tensor) -> None:
    """torch's fused Adam/AdamW step with ``grad_scale = 1 / coef``: the kernel divides every gradient by it as it
    reads it (and stores the result back into ``.grad``); ``found_inf`` stays unset, so no step is skipped."""
    devices = {(g.to_local() if hasattr(g, "to_local") else g).device for g in _grads(opt)}
    # The optimizer copies grad_scale to each gradient device. Keep it on the CPU when CPU gradients are among them:
    # the CPU kernel reads it on the host, and a non-blocking device-to-host copy may not have landed by then.
    if not devices:
        device = coef.device
    elif any(d.type == "cpu" for d in devices):
        device = torch.device("cpu")
    else:
        device = next(iter(devices))
    opt.grad_scale = torch.reciprocal(coef).to(device=device, dtype=torch.float32)
    try:
        opt.step()
    finally:
        del opt.grad_scale


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
    fuse_local_experts: bool = True,
    expert_grads: ExpertGradOptions = ExpertGradOptions(),  # noqa: B008 (frozen, so one shared default is safe)
) -> OptimizersContainer:
    """AdamW over every parameter of a model sharded by ``shard_model``, as an :class:`OptimizersContainer`.

    Build it after the weights are materialised and loaded or initialised (in float32).

    Args:
        model: the sharded model.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters, for every parameter.
        fused: for the parameters FSDP2 manages: torch's fused AdamW (True), its for-loop / foreach
            implementation (False), or None: :class:`OnePassAdamW` (one triton pass per parameter on CUDA, the
            clip coefficient read in it; torch's for-loop arithmetic elsewhere) where they are all float32, else
            torch's fused AdamW on CUDA and its for-loop on CPU.
        fuse_local_experts: update the experts kept out of FSDP (``ep_fsdp`` of one rank) with
            :class:`LocalExpertAdamW` (the float32 masters in its state, their parameters in the compute dtype);
            False, or no such experts: torch's AdamW steps every parameter.
        expert_grads: for :class:`LocalExpertAdamW`: the step's micro-batches, over which the experts' weight
            gradients are kept as factors and formed once, in the last backward, by themselves
            (:class:`ExpertGradOptions`; the default, one micro-batch, forms them at every backward).

    Returns:
        ``OptimizersContainer([LocalExpertAdamW, OnePassAdamW])``, or ``OptimizersContainer([OnePassAdamW])`` (or
        torch's ``AdamW`` in the place of ``OnePassAdamW``, by ``fused``).
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("build_optimizer: the model is on the meta device; materialise and load its weights first")
    owners = local_expert_params(model) if fuse_local_experts else {}
    children: list[torch.optim.Optimizer] = []
    if any(p.requires_grad for p, *_ in owners.values()):
        children.append(
            LocalExpertAdamW(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, expert_grads=expert_grads)
        )
    taken = {id(p) for o in children for g in o.param_groups for p in g["params"]}
    rest = [p for p in model.parameters() if id(p) not in taken and p.requires_grad]  # a frozen base: none
    if rest and fused is None and all(p.dtype == torch.float32 for p in rest):
        children.append(OnePassAdamW(rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    elif rest:
        if fused is None:
            fused = all(p.device.type == "cuda" for p in rest)
        children.append(
            torch.optim.AdamW(
                rest,
                lr=lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                fused=fused,
                foreach=False if fused else None,
            )
        )
    return OptimizersContainer(children)
