"""A toy MoE language model with a parallel plan, for tests of sharding, prefetch and checkpoints.

# T tokens, K top-k, D hidden, E experts, F expert width, V vocab

``ToyMoELM``: embedding → layers (token mixer, router, fused experts) → norm → head, with
``get_parallel_plan()`` naming ``embed``, ``layers.*`` and ``head`` as FSDP units. Its expert module routes through
``self.dispatch`` (``moeshard.ep``'s protocol: a ``LocalDispatch`` until ``apply_ep`` installs its EP group's
dispatcher) from its own ``forward`` (FSDP2 gathers a unit's parameters when the unit is called), so it runs
unchanged on one process or with EP + FSDP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moeshard.ep import LocalDispatch, ParallelPlan
from moeshard.fsdp_moe._local_adamw import local_expert_params
from moeshard.fsdp_moe._local_experts import dtensor_like, scaled
from moeshard.fsdp_moe._shard import clean_fqn, get_sharding_info
from moeshard.fsdp_moe._state_dict import _children, _masters, _to_global

__all__ = ["ToyExperts", "ToyMoELM", "checkpoint_snapshot", "full_tensors"]


def checkpoint_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full parameters and optimizer state as numpy arrays by ``model.FQN`` / ``optim.FQN.key``, gathered through
    the checkpoint format itself (:func:`moeshard.fsdp_moe.get_state_dict`), plus each parameter's ``lr`` under
    ``lr.FQN``; for comparing layouts (and fused / unfused expert updates) in tests (all ranks gather)."""
    import numpy as np

    from moeshard.fsdp_moe._state_dict import get_state_dict

    sd = get_state_dict(model, optimizer)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().numpy()

    out = {f"model.{k}": full(v) for k, v in sd["model"].items()}
    for fqn, state in sd["optimizer"]["state"].items():
        out.update({f"optim.{fqn}.{k}": full(v) for k, v in state.items()})
    for group in sd["optimizer"]["param_groups"]:
        out.update({f"lr.{fqn}": np.array(group["lr"]) for fqn in group["params"]})
    return out


def full_tensors(
    model: nn.Module, grads: bool = False, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of a sharded model as a full plain tensor, by FQN (all ranks gather).

    Experts updated by a :class:`LocalExpertAdamW` (pass it, or the container holding it) show
    their float32 master, and their gradient as the float32 path holds it (divide factor applied). For tests and
    debugging only: it all-gathers everything.
    """
    info = get_sharding_info(model)
    fused = {}
    if not grads:  # (the masters: refused without the optimizer that holds them)
        fused = {id(p): o for o in _masters(model, _children(optimizer)) for g in o.param_groups for p in g["params"]}
    in_compute = {i: st for i, (_, st, name, _) in local_expert_params(model).items() if name in st.in_compute_dtype}
    out = {}
    for raw_fqn, param in model.named_parameters():
        fqn = clean_fqn(raw_fqn)
        if grads:
            t = param.grad
            if t is not None and id(param) in in_compute:
                t = dtensor_like(scaled(t.to_local(), in_compute[id(param)].scale, torch.float32), t)
        else:
            t = fused[id(param)].master(param) if id(param) in fused else param.detach()
        if t is None:
            continue
        meta = info.expert_params.get(fqn) if info is not None else None
        if meta is not None:
            t = _to_global(t, meta, info.meshes)
        out[fqn] = t.full_tensor() if isinstance(t, DTensor) else t.clone()
    return out


class ToyExperts(nn.Module):
    """Fused SwiGLU experts: ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]`` (E local after EP)."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.num_experts = num_experts  # global count; the parameters hold E / ep_size after apply_ep
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * width, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, width) / width**0.5)
        self.dispatch = LocalDispatch(num_experts)  # apply_ep installs its EP group's dispatcher (the protocol)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.dispatch(x_TD, ids_TK, weights_TK, self.gate_up_proj, self.down_proj)


class _Layer(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden: int, width: int):
        super().__init__()
        self.top_k = top_k
        self.norm1 = nn.RMSNorm(hidden)
        self.mixer = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = ToyExperts(num_experts, hidden, width)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TD = x_TD + self.mixer(self.norm1(x_TD))
        h_TD = self.norm2(x_TD)
        probs_TE = self.router(h_TD).float().softmax(-1)
        weights_TK, ids_TK = probs_TE.topk(self.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        return x_TD + self.experts(h_TD, ids_TK, weights_TK)


class ToyMoELM(nn.Module):
    """A tiny MoE LM; ``forward(ids_BS, labels_BS, num_items_in_batch=None) -> loss`` (next-token CE)."""

    def __init__(
        self, vocab: int = 32, hidden: int = 16, width: int = 8, num_experts: int = 8, top_k: int = 2, layers: int = 2
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(num_experts, top_k, hidden, width) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_parallel_plan(self) -> ParallelPlan:
        """Experts sharded on dim 0 by EP; embedding, each layer and the head are FSDP units."""
        return ParallelPlan(
            ep_plan={"layers.*.experts.gate_up_proj": Shard(0), "layers.*.experts.down_proj": Shard(0)},
            fsdp_units=("embed", "layers.*", "head"),
        )

    def forward(
        self, ids_BS: torch.Tensor, labels_BS: torch.Tensor, num_items_in_batch: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        B, S = ids_BS.shape
        x_TD = self.embed(ids_BS).view(B * S, -1)
        for layer in self.layers:
            x_TD = layer(x_TD)
        logits_TV = self.head(self.norm(x_TD)).float()
        # Next-token targets: the label of position s + 1; the last position of each sequence has none.
        targets_BS = F.pad(labels_BS[:, 1:], (0, 1), value=-100)
        total = F.cross_entropy(logits_TV, targets_BS.reshape(-1), ignore_index=-100, reduction="sum")
        if num_items_in_batch is None:
            num_items_in_batch = (targets_BS != -100).sum()
        return total / num_items_in_batch
