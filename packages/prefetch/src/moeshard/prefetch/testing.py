"""A toy MoE decoder sharded like the real one, and checks of a recorded step against a schedule, for tests of
prefetch schedules (torch only).

    from moeshard.prefetch.testing import ToyMoE, check_scheduled_order, shard_toy, train_and_record

    model = ToyMoE(num_layers=4, ep_rank=meshes.ep_rank, ep_size=meshes.ep_size)
    stages = shard_toy(model, fsdp_mesh=meshes.fsdp, ep_fsdp_mesh=meshes.ep_fsdp)
    schedule = build_schedule(stages, depth=1)
    apply_schedule(schedule)
    losses, trace = train_and_record(model, stages, lambda step: model(tokens_BT, labels_BT))
    check_scheduled_order(schedule.as_dict(), trace)

Structure (names as in the real model): ``embed`` | ``layers.{i}`` = attention part + router + ``experts`` | ``head``
(final norm + output projection). Sharding mirrors ``moeshard.fsdp_moe.shard_model`` on an ep_fsdp mesh of more
than one rank: each layer's ``experts`` is ``fully_shard``-ed on the ep_fsdp mesh with ``Shard(1)`` (after the EP
slice on dim 0), then the layer, the embedding and the head on the global mesh, then the root (the toy does so on
a one-rank ep_fsdp mesh too, where ``shard_model`` keeps experts out of FSDP). Every token is mixed over this rank's local experts
(dense softmax gate): the token all-to-all belongs to ``moeshard.ep`` and plays no part in when FSDP all-gathers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

from moeshard.prefetch._record import UnshardTrace, record_unshard_order
from moeshard.prefetch._schedule import StageLike, stage_units

__all__ = [
    "ToyMoE",
    "ToyStage",
    "check_default_order",
    "check_scheduled_order",
    "layer_stages",
    "shard_toy",
    "train_and_record",
]

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


# ---------------------------------------------------------------------------------------------------- checks


def train_and_record(
    model: nn.Module,
    stages: Sequence[StageLike],
    loss_fn: Callable[[int], torch.Tensor],
    *,
    steps: int = 3,
    recorded_step: int = 1,
    lr: float = 1e-2,
) -> tuple[list[float], UnshardTrace]:
    """Train ``steps`` steps with AdamW, recording the all-gather order of step ``recorded_step``.

    Apply the schedule under test first. ``loss_fn(step)`` runs the forward and returns the loss.

    Returns:
        The losses of every step and the recorded step's trace.
    """
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, trace = [], None
    for step in range(steps):
        recorder = record_unshard_order(stage_units(stages)) if step == recorded_step else contextlib.nullcontext()
        with recorder as recorded:
            loss = loss_fn(step)
            loss.backward()
        if step == recorded_step:
            trace = recorded
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert trace is not None, f"recorded_step={recorded_step} is not below steps={steps}"
    return losses, trace


def layer_stages(schedule: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """``(first unit, units)`` of each decoder-layer stage of ``schedule`` (``PrefetchSchedule.as_dict()``): every
    stage but the first (embedding) and the last (head)."""
    return [(s["unit"], s["units"]) for s in schedule["stages"][1:-1]]


def check_scheduled_order(schedule: dict[str, Any], trace: UnshardTrace) -> None:
    """Assert that a recorded step followed ``schedule`` (``PrefetchSchedule.as_dict()``, depth >= 1).

    Layer i's hooks request layer i+1's units in forward and layer i-1's in backward, before layer i ends; each
    prefetch is issued by the first stage that lists it, between that stage's begin and the next unit's begin, and
    is recorded as a prefetch.

    Raises:
        AssertionError: naming the unit (and phase) out of order.
    """
    layers, stages = layer_stages(schedule), schedule["stages"]
    for (unit, _), (_, next_units) in zip(layers, layers[1:]):
        for target in next_units:
            assert trace.index("unshard", target, "forward") < trace.index("forward_end", unit, "forward"), target
    for (_, prev_units), (unit, _) in zip(layers, layers[1:]):
        for target in prev_units:
            assert trace.index("unshard", target, "backward") < trace.index("backward_end", unit, "backward"), target
    for phase, order in (("forward", stages), ("backward", stages[::-1])):
        requester: dict[str, str] = {}
        for s in order:
            for target in s[phase]:
                requester.setdefault(target, s["unit"])
        for target, owner in requester.items():
            begin = trace.index(f"{phase}_begin", owner, phase)
            issued = trace.index("unshard", target, phase)
            later = [i for i, e in enumerate(trace.events) if i > begin and e.kind == f"{phase}_begin"]
            assert begin < issued < (later[0] if later else len(trace.events)), (phase, target, owner)
            assert trace.events[issued].prefetch, (phase, target)


def check_default_order(schedule: dict[str, Any], trace: UnshardTrace) -> None:
    """Assert FSDP2's own order (no schedule applied): a layer's units are all-gathered only once its own forward
    begins, and in backward a layer's later units only once that layer's backward begins.

    FSDP2's default backward prefetch (reverse post-forward order, one unit ahead) reaches the previous layer's
    first unit from this layer's last one, so only the previous layer's other units are checked in backward.

    Raises:
        AssertionError: naming the unit all-gathered early.
    """
    layers = layer_stages(schedule)
    for (unit, _), (_, next_units) in zip(layers, layers[1:]):
        end = trace.index("forward_end", unit, "forward")
        for target in next_units:
            issued = trace.index("unshard", target, "forward")
            assert issued > trace.index("forward_begin", target, "forward") > end, target
            assert not trace.events[issued].prefetch, target
    for (_, prev_units), (unit, _) in zip(layers, layers[1:]):
        end = trace.index("backward_end", unit, "backward")
        for target in prev_units[1:]:
            assert trace.index("unshard", target, "backward") > end, target
