"""AdamW for the expert parameters that ``shard_model`` kept out of FSDP, with float32 masters in its own state.

Where ``ep_fsdp`` has one rank the experts stay out of FSDP (``_local_experts``) and hold most of the model's
parameters. With torch's AdamW their parameters are the float32 masters, and every step each of them costs,
besides AdamW's own 28 bytes (read parameter, gradient, two moments; write parameter and moments): a cast of the
master to the compute dtype in forward (6 bytes), the compute-dtype gradient cast and scaled into float32 (6), the
clipping norm's read of that float32 gradient (4) and, with the clip coefficient applied inside torch's fused AdamW,
its write-back of the clipped gradient (4): 48 bytes. :class:`LocalExpertAdamW` moves the masters into the
optimizer, as master-weight optimizers do: the parameters themselves hold what the forward computes with (the
compute dtype, e.g. bf16), their gradients arrive in ``param.grad`` in that dtype, and one pass per parameter reads
the gradient (2), the master and both moments and writes the master, both moments and the parameter (2); with the
clipping norm's read of the gradient (2), 30 bytes per parameter (28 where the step formed the gradients from kept
factors: their sum of squares comes from the forming grouped GEMM, see ``_grad_records``).

With a bf16 compute dtype the masters are held split (:func:`~moeshard.fsdp_moe.split_master`): the
bf16 parameter is each float32 master's high half (rounded to nearest, ties away from zero) and the state holds the
int16 low halves, so that ``bits(master) = bits(param) << 16 + low`` exactly. The pass reads and writes 2 + 2 bytes
of master instead of 4 and writes no separate copy: 28 bytes per parameter with the clipping norm's read (26 where
the gradients were formed from factors), and 2 bytes less held per parameter. The masters are those of the float32
path bit for bit; the parameter differs from a round-to-even cast of its master at exact ties (one bf16 unit, about
2^-16 of the elements).

The contract:

- Build it after the weights are loaded or initialised, in float32 (``to_empty`` + ``load_hf_weights`` /
  ``init_weights``): construction takes each parameter's current float32 value as its master and switches the
  parameter to the compute dtype of ``shard_model``'s mixed-precision policy (``torch.utils.swap_tensors``: the
  Parameter objects stay the same). Where the compute dtype is float32 the master *is* the parameter.
- From then on the model holds compute-dtype weights: ``model.state_dict()`` alone is not a checkpoint of them;
  :func:`moeshard.fsdp_moe.get_state_dict` / ``save_checkpoint`` with this optimizer (or the container holding it)
  write the float32 masters under the parameters' names, in the format torch's AdamW over float32 parameters would.
- ``param.grad`` is the compute-dtype gradient *before* the gradient divide factor (``1 / W``, W the world size,
  which FSDP2 applies to every other parameter): the update multiplies by it in float32 as it reads the gradient,
  exactly as the float32 path does, which a bf16 ``param.grad`` could not hold for a W that is not a power of two.
  So clip these gradients through :meth:`grad_norms` (what ``OptimizersContainer.clip_grad_norm_`` does), not by
  reading ``param.grad``.
- Gradient accumulation over micro-batches sums in the compute dtype: autograd adds each micro-batch's gradient
  into ``param.grad`` in the parameter's dtype (torch refuses a float32 ``param.grad`` on a bf16 parameter, and
  a float32 sum elsewhere would be a second gradient store beside ``param.grad`` — 4 more bytes per parameter and
  a read and write per micro-batch). With one micro-batch the update sees exactly the float32 path's gradient;
  with k micro-batches each addition rounds to bf16 (relative 2^-9 per element and addition), which the Adam
  update, normalised by the second moment, carries into the parameters at about that relative size (tested
  against the float32 path over 3 steps of 2 micro-batches: the first update within 1e-3 tensor by tensor, the
  later ones, from weights that differ by that much, within 2e-2 over the whole model). Keep
  ``fuse_local_experts=False`` where a float32 sum over many micro-batches matters.

The arithmetic is torch's for-loop AdamW (``_single_tensor_adam``) in float32: on CPU those very tensor
operations; on CUDA one triton kernel per parameter (``_triton``; under triton's interpreter on CPU in the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from moeshard.fsdp_moe._adamw_step import (
    adamw_step,
    adamw_step_split,
    check_group,
    hyper_parameters,
    joined_master,
    local_tensor,
    split_master,
    triton_available,
)
from moeshard.fsdp_moe._deferral import ExpertGradOptions
from moeshard.fsdp_moe._grad_records import drop_kept_factors, formed_squares, kept_factors
from moeshard.fsdp_moe._local_experts import LocalExperts, dtensor_like, local_experts_state
from moeshard.fsdp_moe._shard import clean_fqn

__all__ = ["LocalExpertAdamW", "local_expert_params"]


def local_expert_params(model: nn.Module) -> dict[int, tuple[nn.Parameter, LocalExperts, str, str]]:
    """``{id(param): (param, its module's state, its name in the module, its FQN)}`` for every parameter of an
    expert module that ``shard_model`` kept out of FSDP, in module order."""
    out = {}
    for mod_name, module in model.named_modules():
        st = local_experts_state(module)
        if st is None:
            continue
        for name, p in st.params.items():
            out[id(p)] = (p, st, name, clean_fqn(f"{mod_name}.{name}" if mod_name else name))
    return out


class LocalExpertAdamW(torch.optim.Optimizer):
    """AdamW over the experts ``shard_model`` kept out of FSDP: float32 masters in its state, one fused pass each.

    (Where ``ep_fsdp`` has one rank; see the module docstring for the contract.) Per parameter its state holds
    ``step`` (a float32 scalar on the CPU, as torch's for-loop AdamW keeps it), ``exp_avg`` and ``exp_avg_sq``
    (float32, laid out like the parameter) and ``master`` (the float32 weight), or, with a bf16 compute dtype,
    ``master_low`` (its int16 low halves, the parameter its high half; :meth:`master` joins them).
    ``state_dict()`` / ``load_state_dict()`` carry ``step``, the moments and a float32 ``master`` either way. Its
    parameter groups have torch AdamW's keys.

    Args:
        model: the model ``shard_model`` sharded (its weights loaded or initialised, in float32).
        params: an iterable of parameters or of parameter-group dicts, every parameter a local expert parameter of
            ``model``; by default every local expert parameter that requires a gradient.
        lr, betas, eps, weight_decay: as torch's AdamW (floats).
        amsgrad, maximize, capturable, differentiable: accepted for torch AdamW's signature; True is refused.
        expert_grads: how the experts' weight gradients accumulate over a step's micro-batches; each
            :meth:`zero_grad` starts a step by them (the default, one micro-batch: formed at every backward).

    Raises:
        ValueError: ``model`` has no local experts; a parameter is not one of them, or is owned by another
            LocalExpertAdamW, or is not a materialised float32 parameter; an option the update does not implement
            (above, L2 weight decay, tensor hyper-parameters).
    """

    def __init__(
        self,
        model: nn.Module,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        expert_grads: ExpertGradOptions = ExpertGradOptions(),  # noqa: B008 (frozen, so one shared default is safe)
    ):
        if not isinstance(expert_grads, ExpertGradOptions):
            raise ValueError(f"LocalExpertAdamW: expert_grads must be an ExpertGradOptions, got {expert_grads!r}")
        self.expert_grads = expert_grads
        self._owners = local_expert_params(model)
        if not self._owners:
            raise ValueError(
                f"LocalExpertAdamW: {type(model).__name__} has no local experts (shard_model keeps experts out of "
                "FSDP only where ep_fsdp has one rank, i.e. EP size = world size); use torch's AdamW"
            )
        if params is None:
            params = [p for p, *_ in self._owners.values() if p.requires_grad]
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=None,
            capturable=capturable,
            differentiable=differentiable,
            fused=None,
            decoupled_weight_decay=True,
        )
        check_group(defaults, "the constructor")
        super().__init__(params, defaults)
        self._start_step()

    def _start_step(self) -> None:
        """Every local expert module counts this step's backwards from here (``ExpertGradOptions``)."""
        for st in {id(st): st for _, st, *_ in self._owners.values()}.values():
            st.start_step(self.expert_grads)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of local expert parameters (refused: any other parameter). Each parameter's float32 value
        becomes its master and the parameter switches to the compute dtype (see the module docstring)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            owner = self._owners.get(id(p))
            if owner is None or owner[0] is not p:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else None
                raise ValueError(
                    f"LocalExpertAdamW updates only the model's local expert parameters (kept out of FSDP by "
                    f"shard_model); got a {type(p).__name__} of shape {shape} that is not one: give it to torch's "
                    "AdamW (build_optimizer splits the parameters)"
                )
            _, st, name, fqn = owner
            if name in st.in_compute_dtype:
                raise ValueError(f"LocalExpertAdamW: {fqn} is updated by another LocalExpertAdamW already")
            if p.device.type == "meta" or p.dtype != torch.float32:
                raise ValueError(
                    f"LocalExpertAdamW: {fqn} is a {p.dtype} parameter on {p.device.type}; build the optimizer "
                    "after the weights are materialised and loaded in float32 (to_empty + load/init): their values "
                    "become the float32 masters"
                )
        check_group({**self.defaults, **param_group}, "a parameter group")
        super().add_param_group({**param_group, "params": params})
        for p in params:
            self._take_master(p)

    @torch.no_grad()
    def _take_master(self, p: nn.Parameter) -> None:
        _, st, name, _ = self._owners[id(p)]
        compute = st.compute_dtype or p.dtype
        local = p.to_local()
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = dtensor_like(torch.zeros_like(local), p)
        state["exp_avg_sq"] = dtensor_like(torch.zeros_like(local), p)
        if compute == torch.bfloat16:
            # Held split: the parameter is the master's high half, the state its low half (see split_master).
            hi, lo = split_master(local)
            p.grad = None
            torch.utils.swap_tensors(p, nn.Parameter(dtensor_like(hi, p), p.requires_grad))
            state["master_low"] = dtensor_like(lo, p)
        else:
            master = dtensor_like(local, p)  # the parameter's float32 storage, now the master's
            if compute != p.dtype:
                p.grad = None
                torch.utils.swap_tensors(p, nn.Parameter(dtensor_like(local.to(compute), p), p.requires_grad))
            state["master"] = master
        st.in_compute_dtype.add(name)  # from now on the forward uses the parameter as it is

    @torch.no_grad()
    def master(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s float32 master, laid out like it: the held tensor, or, where it is held split (a bf16
        compute dtype), a new tensor joined from the parameter and the low halves."""
        state = self.state[param]
        if "master_low" not in state:
            return state["master"]
        return dtensor_like(joined_master(local_tensor(param), local_tensor(state["master_low"])), param)

    def fqn(self, param: torch.Tensor) -> str:
        """The model's FQN of one of this optimizer's parameters (as in checkpoints)."""
        return self._owners[id(param)][3]

    def grad_factor(self, param: torch.Tensor) -> float:
        """The factor the update multiplies ``param.grad`` by: ``1 / W`` (the divide factor FSDP2 applies to the
        other parameters)."""
        return self._owners[id(param)][1].scale

    @torch.no_grad()
    def grad_norms(self, norm_type: float = 2.0) -> list[torch.Tensor]:
        """This rank's gradient norms as the update reads them (the divide factor applied), float32 scalars.

        Every entry is a piece of the expert mesh's kind (no other rank holds it): a global norm sums their p-th
        powers over the world once. On CUDA the 2-norm of all gradients on a device comes as one entry (one
        triton pass over the compute-dtype gradients); only the sum of the entries' p-th powers is meaningful.
        A 2-norm takes the sum of squares recorded where the local experts formed a gradient from kept factors
        (``formed_squares``) instead of reading that gradient again.
        """
        self._check_formed()
        two = float(norm_type) == 2.0
        grads, factors = [], []
        recorded: dict[tuple[torch.device, float], list[torch.Tensor]] = {}  # Σ grad² when formed, by factor²
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                squares = formed_squares(p) if two else None
                if squares is not None:
                    recorded.setdefault((squares.device, self.grad_factor(p) ** 2), []).append(squares)
                    continue
                grads.append(local_tensor(p.grad))
                factors.append(self.grad_factor(p))
        formed: dict[torch.device, torch.Tensor] = {}  # Σ (factor · grad)² of the formed gradients, per device
        for (device, f2), squares in recorded.items():
            total = torch.stack(squares).sum() * f2 if f2 != 1.0 else torch.stack(squares).sum()
            formed[device] = total if device not in formed else formed[device] + total
        out = []
        by_device: dict[torch.device, list[int]] = {}
        for i, g in enumerate(grads):
            by_device.setdefault(g.device, []).append(i)
        for device, idx in by_device.items():
            if two and device.type == "cuda" and triton_available():
                from moeshard.fsdp_moe import _triton

                ts = [grads[i].contiguous() for i in idx]
                total = _triton.sum_of_squares(ts, [factors[i] ** 2 for i in idx], [None] * len(idx))
                out.append((total + formed.pop(device) if device in formed else total).sqrt())
                continue
            norms = torch._foreach_norm([grads[i] for i in idx], norm_type, dtype=torch.float32)
            out.extend(n * factors[i] if factors[i] != 1.0 else n for n, i in zip(norms, idx, strict=True))
        out.extend(total.sqrt() for total in formed.values())
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_mult: torch.Tensor | None = None) -> Any:
        """One AdamW step of every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (as torch's optimizers).
            grad_mult: a float32 scalar tensor every gradient is multiplied by as it is read (the clip
                coefficient ``OptimizersContainer`` hands over); None: 1.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_formed()
        for i, group in enumerate(self.param_groups):
            check_group(group, f"parameter group {i}")
            hyper = hyper_parameters(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                step_t = state["step"]
                step_t += 1  # a CPU tensor: reading it back does not wait for the device
                moments = (local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"]))
                kw = dict(grad_factor=self.grad_factor(p), grad_mult=grad_mult, step=int(step_t.item()), **hyper)
                if "master_low" in state:
                    adamw_step_split(
                        local_tensor(p), local_tensor(state["master_low"]), local_tensor(p.grad), *moments, **kw
                    )
                    continue
                master = local_tensor(state["master"])
                out = local_tensor(p) if p.dtype != master.dtype else None
                adamw_step(master, local_tensor(p.grad), *moments, out, **kw)
        return loss

    def _check_formed(self) -> None:
        """Form what a step that deferred by itself still keeps (it had fewer backwards than ``expert_grads``
        says); refuse to read gradients kept by :func:`defer_expert_weight_grads` (it was not turned off)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self._owners[id(p)][1]
                if kept_factors(p) and not st._explicit:
                    st._form(p, [])
                if kept_factors(p):
                    raise RuntimeError(
                        f"LocalExpertAdamW: the gradient of {self.fqn(p)} is still partly kept as factors "
                        f"({len(kept_factors(p))} micro-batches): call defer_expert_weight_grads(model, False) before "
                        "the step's last backward, or zero_grad() to drop them"
                    )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; also drops weight-gradient factors kept for these parameters and starts a step
        (``expert_grads``)."""
        for group in self.param_groups:
            for p in group["params"]:
                drop_kept_factors(p)
        super().zero_grad(set_to_none)
        self._start_step()

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with each parameter's float32 ``master`` (joined where it is held split, see
        :meth:`master`): the format does not depend on how the masters are held."""
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in enumerate(params):  # torch numbers the parameters in group order
            entry = sd["state"].get(i)
            if entry is not None and "master_low" in entry:
                sd["state"][i] = {**{k: v for k, v in entry.items() if k != "master_low"}, "master": self.master(p)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of a LocalExpertAdamW over the same parameters (same layout).

        Unlike torch's implementation, which casts floating-point state to each parameter's dtype, the masters and
        moments stay float32; the parameters are then rewritten from the masters. (Checkpoints across layouts and
        from torch's AdamW go through :func:`moeshard.fsdp_moe.load_checkpoint`.)
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "LocalExpertAdamW.load_state_dict: the state dict's parameter groups do not match this optimizer's "
                "(number of groups or of parameters per group)"
            )
        for i, saved in enumerate(saved_groups):
            check_group({**self.param_groups[i], **saved}, f"loaded parameter group {i}")
        with torch.no_grad():
            for saved, group in zip(saved_groups, self.param_groups, strict=True):
                for key, p in zip(saved["params"], group["params"], strict=True):
                    entry = state_dict["state"].get(key)
                    if entry is None or "master" not in entry:
                        raise ValueError(
                            f"LocalExpertAdamW.load_state_dict: no float32 master for {self.fqn(p)} in the state "
                            "dict (one of torch's AdamW?); load such checkpoints with moeshard.fsdp_moe."
                            "load_checkpoint, which takes the masters from the model entries"
                        )
                    self.load_param_state(p, entry)
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    @torch.no_grad()
    def load_param_state(self, param: torch.Tensor, entry: dict[str, Any]) -> None:
        """Copy ``entry``'s ``step``, ``exp_avg``, ``exp_avg_sq`` and, if present, ``master`` into ``param``'s state
        (tensors laid out like this rank's piece, or DTensors like the state's), then rewrite the parameter from
        the master."""
        state = self.state[param]
        for key in ("exp_avg", "exp_avg_sq") if "master_low" in state else ("master", "exp_avg", "exp_avg_sq"):
            if key in entry:
                _copy_into(state[key], entry[key], f"{self.fqn(param)}.{key}")
        if "master_low" in state and "master" in entry:
            master = torch.empty_like(local_tensor(state["master_low"]), dtype=torch.float32)
            _copy_into(master, entry["master"], f"{self.fqn(param)}.master")
            hi, lo = split_master(master)
            local_tensor(param).copy_(hi)
            local_tensor(state["master_low"]).copy_(lo)
        step = entry["step"]
        state["step"].copy_(step if isinstance(step, torch.Tensor) else torch.tensor(float(step)))
        self.write_param(param)

    @torch.no_grad()
    def write_param(self, param: torch.Tensor) -> None:
        """Write ``param`` from its master (cast to the compute dtype; nothing to do where the master is the
        parameter, or where it is held split: the parameter is its high half): after a master was changed other than
        by :meth:`step`."""
        if "master_low" in self.state[param]:
            return
        master = local_tensor(self.state[param]["master"])
        local = local_tensor(param)
        if local.data_ptr() != master.data_ptr():
            local.copy_(master)


def _copy_into(dst: torch.Tensor, src: Any, what: str) -> None:
    src_local = local_tensor(src) if isinstance(src, torch.Tensor) else None
    dst_local = local_tensor(dst)
    if src_local is None or tuple(src_local.shape) != tuple(dst_local.shape):
        shape = tuple(src_local.shape) if src_local is not None else type(src).__name__
        raise ValueError(f"{what}: the loaded piece has shape {shape}, this rank holds {tuple(dst_local.shape)}")
    if src_local.data_ptr() != dst_local.data_ptr():
        dst_local.copy_(src_local)
