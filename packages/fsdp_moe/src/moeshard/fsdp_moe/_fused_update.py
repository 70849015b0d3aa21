"""The local experts' AdamW update fused with their gradient cast and their next compute copy.

Where ``ep_fsdp`` has one rank the experts stay out of FSDP (``moeshard.fsdp_moe._local_experts``) and hold most
of the model's parameters. Unfused, every step each of their parameters costs, besides AdamW's own 28 bytes
(read parameter, gradient, two moments; write parameter and moments): a cast of the float32 master to the compute
dtype in forward (6 bytes), the compute-dtype gradient cast and scaled into float32 (6), the clipping norm's read
of that float32 gradient (4) and, with the clip coefficient handed to torch's fused AdamW, its write-back of the
clipped gradient (4). :func:`fuse_local_expert_updates` lets the optimizer's step update them in one pass instead:
it reads the compute-dtype gradient as backward left it (2 bytes), the master and the moments, and writes the
master, the moments and the compute copy the next forward uses (2): 30 bytes per parameter instead of 48.

The optimizer stays the user's ``torch.optim.AdamW`` (or ``Adam`` with ``decoupled_weight_decay=True`` or no
weight decay): its parameter groups, learning-rate schedulers, ``state_dict`` (the same ``step``, ``exp_avg``,
``exp_avg_sq`` tensors, created as torch creates them) and DCP checkpoints are unchanged; a step pre-hook updates
the local experts, then torch's step updates every other parameter as usual (after torch's step instead where step
pre-hooks registered later might change the hyper-parameters); their ``param.grad`` stays
None (their gradient waits as a pending gradient, see :func:`moeshard.fsdp_moe.expert_grad`).
:func:`moeshard.fsdp_moe.clip_grad_norm_` counts the pending gradients and clips them as the others (in place, or
handed to the update as the fused optimizer's ``grad_scale``). ``optimizer.zero_grad()`` drops them as well.

The update's arithmetic is torch's for-loop AdamW (``_single_tensor_adam``) in float32: on CPU it is those very
tensor operations (bit for bit the unfused result), on CUDA one triton kernel per parameter.
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moeshard.fsdp_moe._local_experts import PendingGrad, _LocalExperts, local_experts_state, pending_to_grad

__all__ = ["fuse_local_expert_updates"]

_HOOK_ATTR = "_moeshard_fused_expert_update"


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    what = "fuse_local_expert_updates"
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam with decoupled weight decay
        raise TypeError(
            f"{what}: the optimizer is a {type(optimizer).__name__}; the fused update is AdamW's (torch.optim.AdamW "
            "or Adam); use one of them, or do not fuse the expert updates"
        )
    if getattr(optimizer, "found_inf", None) is not None:
        raise ValueError(f"{what}: optimizer.found_inf is set (torch.amp.GradScaler); the fused update has no skip")
    for i, g in enumerate(optimizer.param_groups):
        unsupported = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if g.get(k)]
        if unsupported:
            raise ValueError(
                f"{what}: parameter group {i} sets {', '.join(unsupported)}, which the fused update does not "
                "implement; turn them off or do not fuse the expert updates"
            )
        if not g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)) and g["weight_decay"]:
            raise ValueError(
                f"{what}: parameter group {i} is Adam with L2 weight decay (decoupled_weight_decay=False); the "
                "fused update is AdamW's: use torch.optim.AdamW, or weight_decay=0"
            )
        for k in ("lr", "betas", "eps", "weight_decay"):
            values = g[k] if k == "betas" else (g[k],)
            if any(isinstance(v, torch.Tensor) for v in values):
                raise ValueError(f"{what}: parameter group {i} has a tensor {k}; give it as a float")


class _FusedExpertUpdate:
    """The step hooks. The pre-hook checks, takes the clip hand-over's ``grad_scale`` and, when no other step
    pre-hook comes after it, updates every fed parameter with a pending gradient and clears it, before torch's step
    updates every other parameter: the long, host-light update is on the device at once, and torch's step, whose
    host work over many smaller parameters takes longer than its device work, runs on the host meanwhile (a loop
    that read the loss just before the step, leaving the device idle, waits only for the first launches). Where
    step pre-hooks registered later follow it (they might change a learning rate), the post-hook updates instead,
    after all of them and torch's step, as an unfused optimizer would see them."""

    def __init__(self, optimizer: torch.optim.Optimizer, entries: list[tuple[nn.Parameter, _LocalExperts, str]]):
        self.optimizer = weakref.ref(optimizer)
        self.entries = entries
        self.groups = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        # The step count of each parameter on the host (no device read per step): {id(param): (the state's step
        # tensor it belongs to, the count)}; re-read once when the state's tensor was replaced (a loaded state).
        self.host_steps: dict[int, tuple[torch.Tensor, int]] = {}
        self.pre_hook_id: int | None = None  # the pre-hook's handle id, set once registered
        self.deferred: list = []  # [grad_scale] of a step whose update waits for the post-hook

    def before(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        from moeshard.fsdp_moe._clip import _check_pending, _refresh_pending

        _check_pending(optimizer, args, kwargs)  # a stale clip hand-over raises before anything is updated
        _check_optimizer(optimizer)
        for p, st, name in self.entries:
            if name in st.pending and p.grad is not None:
                raise RuntimeError(
                    f"local expert parameter {name!r} has both a pending gradient (its fused update) and a "
                    "param.grad set by other code; set only one of them"
                )
        self.deferred.clear()
        if self._last_pre_hook(optimizer):
            self.update(optimizer, getattr(optimizer, "grad_scale", None))
            _refresh_pending(optimizer)  # the clip hand-over's own check (if it runs after us) no longer sees them
        else:  # (the clip's own post-hook removes optimizer.grad_scale after the step, possibly before ours runs)
            self.deferred.append(getattr(optimizer, "grad_scale", None))

    def after(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self.deferred:
            self.update(optimizer, self.deferred.pop())

    def _last_pre_hook(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether every step pre-hook after ours is the clip hand-over's check (which changes nothing)."""
        from moeshard.fsdp_moe._clip import _check_pending

        hooks = getattr(optimizer, "_optimizer_step_pre_hooks", None)  # torch's registry, in registration order
        if hooks is None or self.pre_hook_id not in hooks:
            return False
        ids = list(hooks)
        return all(hooks[i] is _check_pending for i in ids[ids.index(self.pre_hook_id) + 1 :])

    def update(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
        todo = [(p, st, name) for p, st, name in self.entries if name in st.pending]
        if not todo:
            return
        steps = []
        for p, _, _ in todo:
            steps.append(self._state(optimizer, p)["step"])
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for s in steps:
            by_device.setdefault(s.device, []).append(s)
        for ts in by_device.values():
            torch._foreach_add_(ts, 1.0)
        for (p, st, name), step_t in zip(todo, steps, strict=True):
            group = optimizer.param_groups[self.groups[id(p)]]
            kept = self.host_steps.get(id(p))  # (the count was incremented on the device above)
            count = kept[1] + 1 if kept is not None and kept[0] is step_t else int(step_t.item())
            self.host_steps[id(p)] = (step_t, count)
            state = optimizer.state[p]
            copy = st.copies.get(name)
            _update(
                _local(p),
                st.pending.pop(name),
                _local(state["exp_avg"]),
                _local(state["exp_avg_sq"]),
                copy[0] if copy is not None and copy[1] is _local(p) else None,
                grad_scale,
                lr=float(group["lr"]),
                beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                step=count,
            )
            st.copy_written(name)

    def _state(self, optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict[str, Any]:
        state = optimizer.state[p]
        if len(state) == 0:  # as torch's Adam._init_group creates it
            group = optimizer.param_groups[self.groups[id(p)]]
            fused = bool(group.get("fused"))
            state["step"] = torch.zeros(
                (),
                dtype=_scalar_dtype(fused),
                device=p.device if fused or group.get("capturable") else "cpu",
            )
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self.host_steps[id(p)] = (state["step"], 0)
        return state


def _scalar_dtype(fused: bool) -> torch.dtype:
    try:  # the dtype torch's Adam gives its step count
        from torch.optim.optimizer import _get_scalar_dtype
    except ImportError:  # pragma: no cover - its rule
        return torch.float32 if fused else torch.get_default_dtype()
    return _get_scalar_dtype(is_fused=fused)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def _update(
    param: torch.Tensor,
    pg: PendingGrad,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    copy: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    bias_correction1 = 1 - beta1**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if param.is_cuda and _triton_ok():
        from moeshard.fsdp_moe import _triton

        _triton.adamw_update(
            param,
            pg.local,
            exp_avg,
            exp_avg_sq,
            copy,
            pg.scale,
            pg.mult,
            grad_scale,
            decay=1 - lr * weight_decay,
            beta1=beta1,
            beta2=beta2,
            step_size=step_size,
            bias_correction2_sqrt=bias_correction2_sqrt,
            eps=eps,
        )
        return
    # torch's _single_tensor_adam, operation for operation (grad_scale: as its fused kernel, a division first).
    grad = pg.materialize(param.dtype)
    if grad_scale is not None:
        grad.div_(grad_scale.to(grad.device))
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if copy is not None:
        copy.copy_(param)


@functools.cache
def _triton_ok() -> bool:
    if os.environ.get("MOESHARD_TRITON_KERNELS", "1") == "0":
        return False
    try:
        from moeshard.fsdp_moe import _triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no triton here: the tensor operations
        return False
    return True


def _zero_grad(states: list[_LocalExperts], original, *args, **kwargs):
    for st in states:
        st.pending.clear()
    return original(*args, **kwargs)


def _other_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """A global step pre-hook: an optimizer other than the fused one steps fed experts (e.g. one built afterwards):
    their pending gradients become ``param.grad`` first, so it updates them as it would have unfused."""
    if hasattr(optimizer, _HOOK_ATTR):
        return  # the fused optimizer: its own step hooks update them
    from moeshard.fsdp_moe._clip import _refresh_pending

    if pending_to_grad([p for g in optimizer.param_groups for p in g["params"]]):
        _refresh_pending(optimizer)  # (a clip hand-over to it counted these gradients already)
        if not _WARNED[0]:
            _WARNED[0] = True
            warnings.warn(
                f"a {type(optimizer).__name__} other than the one passed to fuse_local_expert_updates steps the "
                "local experts: their gradients are handed to it as param.grad (unfused, slower); call "
                "fuse_local_expert_updates with this optimizer to fuse them",
                stacklevel=3,
            )


_WARNED = [False]
_GLOBAL_HOOK: list = []


def fuse_local_expert_updates(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Let ``optimizer.step()`` update ``model``'s local experts in one fused pass (see the module docstring).

    Call it once, after building the optimizer over the sharded model (``shard_model`` keeps the experts out of
    FSDP where ``ep_fsdp`` has one rank; elsewhere there is nothing to fuse and this does nothing). From then on:
    the local experts' ``param.grad`` stays None and their gradients wait as pending gradients
    (:func:`moeshard.fsdp_moe.expert_grad` reads one); ``clip_grad_norm_`` and ``get_total_norm`` of
    ``moeshard.fsdp_moe`` include them; ``optimizer.step()`` applies and clears them; ``optimizer.zero_grad()``
    clears them (``model.zero_grad()`` does not). The compute-dtype copy of each expert weight stays allocated
    between steps (the memory the forward's cast held from forward to backward anyway).

    Another optimizer stepping these parameters later (one built afterwards, say) still updates them: its step
    first turns their pending gradients into ``param.grad`` (with a warning; unfused).

    Returns:
        The number of parameters whose updates are fused (0: none of ``model``'s experts are local).

    Raises:
        TypeError / ValueError: the optimizer is not AdamW-like, or uses an option the fused update lacks
            (amsgrad, maximize, capturable, differentiable, tensor hyper-parameters, L2 weight decay);
            a local expert parameter is not among the optimizer's; this optimizer was fused already.
    """
    states = [st for m in model.modules() if (st := local_experts_state(m)) is not None]
    if not states:
        return 0
    _check_optimizer(optimizer)
    if hasattr(optimizer, _HOOK_ATTR):
        raise ValueError("fuse_local_expert_updates: this optimizer's expert updates are fused already")
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    entries = []
    for st in states:
        if st.fed:
            raise ValueError(
                "fuse_local_expert_updates: the model's experts are fed to another optimizer already; one "
                "optimizer updates them"
            )
        for name, p in st.params.items():
            if id(p) not in in_optimizer:
                raise ValueError(
                    f"fuse_local_expert_updates: local expert parameter {name!r} is not among the optimizer's "
                    "parameters; build the optimizer over model.parameters() after shard_model"
                )
            if p.requires_grad:
                entries.append((p, st, name))
    if not _GLOBAL_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_other_optimizer_step))
    hook = _FusedExpertUpdate(optimizer, entries)
    handle = (optimizer.register_step_pre_hook(hook.before), optimizer.register_step_post_hook(hook.after))
    hook.pre_hook_id = handle[0].id
    optimizer.zero_grad = functools.partial(_zero_grad, states, optimizer.zero_grad)
    setattr(optimizer, _HOOK_ATTR, (hook, handle))
    for st in states:
        st.feed()
    return len(entries)
