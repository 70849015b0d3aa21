"""AdamW over float32 parameters (FSDP2's shards) in one pass per parameter, the clip coefficient read in that pass.

torch's fused AdamW reads the parameter, the gradient and both moments and writes the parameter and both moments
(28 bytes per parameter); handed the clip coefficient as ``grad_scale``, it also writes the clipped gradient back
(32 bytes), below the memory bound (``docs/performance.md``).
:class:`OnePassAdamW` is torch's AdamW (its arguments, state, state dict and parameter groups) whose step, on
CUDA, is the triton pass that updates the local experts (``_triton.adamw_update``): 28 bytes near the memory bound, the
clip coefficient multiplied in as the gradient is read (``step(grad_mult=...)``), the gradient left as it was.
Elsewhere (CPU, or a parameter whose tensors do not share one dense layout) the step runs torch's for-loop AdamW's
tensor operations, which give the same numbers as ``torch.optim.AdamW(foreach=False)``.

``build_optimizer`` gives it every parameter FSDP2 manages (``fused=None``): with ``ep_fsdp`` > 1 that is every
expert too, so the 2-node job's whole update runs through it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from moeshard.fsdp_moe._adamw_step import adamw_step, check_group, hyper_parameters, local_tensor

__all__ = ["OnePassAdamW"]


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of ``t``'s dims of size > 1 (a size-1 dim's stride says nothing about where elements are)."""
    return tuple(st for st, n in zip(t.stride(), t.shape, strict=True) if n != 1)


def _flat(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``t``'s elements in memory order where they fill one dense block (any order of dims): an
    elementwise pass over tensors of one layout pairs the same elements through such views. None otherwise."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return None
        expected *= n
    return t.as_strided((t.numel(),), (1,))


def _same_layout(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
    """``(param, grad, exp_avg, exp_avg_sq)`` as 1-D views in one memory order (the gradient copied into the
    parameter's layout when it has another), or None where the parameter is not dense or a moment's layout is not
    the parameter's."""
    if _flat(param) is None or _layout(exp_avg) != _layout(param) or _layout(exp_avg_sq) != _layout(param):
        return None
    if _layout(grad) != _layout(param):
        grad = torch.empty_like(param, dtype=grad.dtype).copy_(grad)
    return _flat(param), _flat(grad), _flat(exp_avg), _flat(exp_avg_sq)


class OnePassAdamW(torch.optim.AdamW):
    """torch's AdamW over float32 parameters whose CUDA step is one triton pass per parameter, clip included.

    (See the module docstring for what the pass reads and writes.)

    Its state (``step`` a float32 scalar on the CPU, ``exp_avg``, ``exp_avg_sq``), ``state_dict()``,
    ``load_state_dict()`` and parameter groups are those of ``torch.optim.AdamW(foreach=False, fused=False)``: a
    checkpoint moves between the two either way. Plain tensors and DTensors (each rank updates its local piece).

    Args:
        params: an iterable of float32 parameters or of parameter-group dicts.
        lr, betas, eps, weight_decay: as torch's AdamW (floats).

    Raises:
        ValueError: a parameter that is not float32; an option the pass does not implement (amsgrad, maximize,
            capturable, differentiable, L2 weight decay, tensor hyper-parameters).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after checking the group's options and that its parameters are float32."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_group(group, f"parameter group {len(self.param_groups) - 1}", type(self).__name__)
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"OnePassAdamW updates float32 parameters in place (their own masters); got a {p.dtype} "
                        f"parameter of shape {tuple(p.shape)}: keep the weights float32 (FSDP2's mixed precision "
                        "casts them for compute), or use torch's AdamW"
                    )
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_mult: torch.Tensor | None = None) -> Any:
        """One AdamW step of every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (as torch's optimizers).
            grad_mult: a float32 scalar tensor every gradient is multiplied by as it is read (the clip
                coefficient ``OptimizersContainer`` hands over); None: 1. The gradients themselves are not
                changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            check_group(group, f"parameter group {i}", type(self).__name__)
            hyper = hyper_parameters(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("OnePassAdamW does not take sparse gradients")
                state = self._state_of(p)
                state["step"] += 1  # a CPU tensor: reading it back does not wait for the device
                param, grad = local_tensor(p), local_tensor(p.grad)
                exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                views = _same_layout(param, grad, exp_avg, exp_avg_sq) if param.is_cuda else None
                adamw_step(
                    *(views or (param, grad, exp_avg, exp_avg_sq)),
                    None,
                    grad_factor=1.0,
                    grad_mult=grad_mult,
                    step=int(state["step"].item()),
                    **hyper,
                )
        return loss

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        """``p``'s state, made at its first step as torch's for-loop AdamW makes it; a ``step`` loaded onto a device
        (from torch's fused AdamW) is moved to the CPU once, so that reading it never waits for the device."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device.type != "cpu":
            state["step"] = state["step"].to("cpu", torch.float32)
        return state
