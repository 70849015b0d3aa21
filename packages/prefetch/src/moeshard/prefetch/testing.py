"""A toy MoE decoder sharded like the real one, for tests of prefetch schedules (torch only).

    from moeshard.prefetch.testing import ToyMoE, shard_toy

    model = ToyMoE(num_layers=4, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
    stages = shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)
    loss = model(tokens_BT, labels_BT)

Structure (names as in the real model): ``embed`` | ``layers.{i}`` = attention part + router + ``experts`` | ``head``
(final norm + output projection). Sharding mirrors ``moeshard.fsdp_moe.shard_model`` on an ep_fsdp mesh of more
than one rank: each layer's ``experts`` is ``fully_shard``-ed on the ep_fsdp mesh with ``Shard(1)`` (after the EP
slice on dim 0), then the layer, the embedding and the head on the global mesh, then the root (the toy does so on
a one-rank ep_fsdp mesh too, where ``shard_model`` keeps experts out of FSDP). Every token is mixed over this rank's local experts
(dense softmax gate): the token all-to-all belongs to ``moeshard.ep`` and plays no part in when FSDP all-gathers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

__all__ = ["ToyMoE", "ToyStage", "shard_toy"]

# B batch, T sequence, D hidden, E local experts, F expert width, V vocab.


@dataclass(frozen=True)
class ToyStage:
    """A stage as ``moeshard.fsdp_moe`` describes one: a name and its ``(name, FSDPModule)`` units."""

    name: str
    modules: tuple[tuple[str, nn.Module], ...]


class ToyExperts(nn.Module):
    """This EP rank's slice of the experts: fused ``gate_up [E, 2F, D]`` and ``down [E, D, F]``."""

    def __init__(self, gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_EXD)
        self.down_proj = nn.Parameter(down_EDF)

    def forward(self, x_BTD: torch.Tensor, gate_BTE: torch.Tensor) -> torch.Tensor:
        gate_BTEF, up_BTEF = torch.einsum("btd,efd->btef", x_BTD, self.gate_up_proj).chunk(2, dim=-1)
        y_BTED = torch.einsum("btef,edf->bted", F.silu(gate_BTEF) * up_BTEF, self.down_proj)
        # A reduction, not an einsum: FSDP2 warns when a unit returns a view.
        return (y_BTED * gate_BTE.unsqueeze(-1)).sum(dim=2)


class ToyLayer(nn.Module):
    """Pre-norm residual block: a small attention stand-in, then the router and the experts."""

    def __init__(self, dim: int, experts: ToyExperts) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.router = nn.Linear(dim, experts.gate_up_proj.shape[0], bias=False)
        self.experts = experts

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        h_BTD = x_BTD + self.attn(self.attn_norm(x_BTD))
        m_BTD = self.mlp_norm(h_BTD)
        return h_BTD + self.experts(m_BTD, self.router(m_BTD).softmax(dim=-1))


class ToyHead(nn.Module):
    """Final norm and output projection."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x_BTD))


class ToyMoE(nn.Module):
    """Embedding, ``num_layers`` MoE layers, head; experts already sliced to this EP rank (dim 0).

    Every rank builds the full model from the same seed and keeps its EP slice of the experts, so the model
    is the same whatever the layout.
    """

    def __init__(
        self,
        num_layers: int = 4,
        *,
        dim: int = 16,
        num_experts: int = 4,
        expert_width: int = 8,
        vocab: int = 32,
        ep_rank: int = 0,
        ep_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep_size={ep_size}")
        gen = torch.Generator().manual_seed(seed)
        local = slice(ep_rank * num_experts // ep_size, (ep_rank + 1) * num_experts // ep_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            layers = []
            for _ in range(num_layers):
                gate_up = torch.randn(num_experts, 2 * expert_width, dim, generator=gen) * dim**-0.5
                down = torch.randn(num_experts, dim, expert_width, generator=gen) * expert_width**-0.5
                layers.append(ToyLayer(dim, ToyExperts(gate_up[local].clone(), down[local].clone())))
            self.layers = nn.ModuleList(layers)
            self.head = ToyHead(dim, vocab)

    def forward(self, tokens_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        h_BTD = self.embed(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(h_BTD)
        logits_BTV = self.head(h_BTD)
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten())


def shard_toy(
    model: ToyMoE, *, fsdp_mesh: DeviceMesh, ep_fsdp_mesh: DeviceMesh, reshard_after_forward: bool = True
) -> list[ToyStage]:
    """``fully_shard`` the toy bottom-up like the real model; return its stages (embed, layers.i, head).

    Expert units average their gradients over ep_fsdp (FSDP2's default); the real model divides by the world
    size, which changes nothing about prefetching.
    """
    experts_placement = lambda param: Shard(1)  # noqa: E731 - dim 0 is the EP slice
    stages = []
    for i, layer in enumerate(model.layers):
        experts = fully_shard(
            layer.experts,
            mesh=ep_fsdp_mesh,
            shard_placement_fn=experts_placement,
            reshard_after_forward=reshard_after_forward,
        )
        unit = fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
        stages.append(ToyStage(f"layers.{i}", ((f"layers.{i}", unit), (f"layers.{i}.experts", experts))))
    embed = fully_shard(model.embed, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    head = fully_shard(model.head, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    assert isinstance(embed, FSDPModule) and isinstance(head, FSDPModule)
    return [ToyStage("embed", (("embed", embed),)), *stages, ToyStage("head", (("head", head),))]
