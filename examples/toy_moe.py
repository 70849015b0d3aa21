"""The same pieces on a MoE model of your own: nothing in moeshard depends on Qwen3's module names.

    python examples/toy_moe.py --out /tmp/toy_single.pt                          # one process, no parallelism
    torchrun --nproc-per-node 4 examples/toy_moe.py --ranks-per-node 2 --out /tmp/toy_ep.pt   # EP 2 x ep_fsdp 2

The toy's experts live at ``blocks.*.ffn.routed.{w_in,w_out}`` and its FSDP units are ``tok_emb``, ``blocks.*``
and ``out``; all the pieces need is its ``get_parallel_plan()`` and an expert module that routes through
``self.dispatch`` (``moeshard.ep``'s protocol: a ``LocalDispatch`` until ``apply_ep`` installs the dispatcher of
its EP group). Under torchrun it applies EP, expert-aware FSDP2 and the prefetch schedule; run alone it is the
plain module. Both write the losses of a few AdamW steps and the full gradients of the first
step, which agree (the tests compare them).
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moeshard.ep import EPInfo, LocalDispatch, ParallelPlan, apply_ep
from moeshard.fsdp_moe import clip_grad_norm_, num_items_for_global_mean, shard_model
from moeshard.meshes import ParallelMeshes, build_meshes
from moeshard.prefetch import apply_schedule, build_schedule

# T tokens, K top-k, D hidden, E experts, F expert width, V vocab, B sequences, S sequence length


class RoutedFFN(nn.Module):
    """Fused SwiGLU experts ``w_in [E, 2F, D]``, ``w_out [E, D, F]`` (E local after EP); the expert module."""

    def __init__(self, num_experts: int, dim: int, width: int) -> None:
        super().__init__()
        self.num_experts = num_experts  # global; apply_ep leaves E / ep_size in the tensors
        self.w_in = nn.Parameter(torch.randn(num_experts, 2 * width, dim) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, dim, width) / width**0.5)
        self.dispatch = LocalDispatch(num_experts)  # apply_ep replaces it with its EP group's dispatcher

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Each token through its top-k experts (exchanged over the EP group when EP is applied)."""
        return self.dispatch(x_TD, ids_TK, weights_TK, self.w_in, self.w_out)


class FFN(nn.Module):
    """Router (softmax top-k, renormalised) and routed experts."""

    def __init__(self, num_experts: int, top_k: int, dim: int, width: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.routed = RoutedFFN(num_experts, dim, width)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``x + experts(x)`` weighted by the router."""
        weights_TK, ids_TK = self.gate(x_TD).float().softmax(-1).topk(self.top_k, dim=-1)
        return self.routed(x_TD, ids_TK, weights_TK / weights_TK.sum(-1, keepdim=True))


class Block(nn.Module):
    """A token-mixing linear layer and the MoE feed-forward, each pre-normed with a residual."""

    def __init__(self, num_experts: int, top_k: int, dim: int, width: int) -> None:
        super().__init__()
        self.norm1, self.mix = nn.RMSNorm(dim), nn.Linear(dim, dim, bias=False)
        self.norm2, self.ffn = nn.RMSNorm(dim), FFN(num_experts, top_k, dim, width)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """One block."""
        x_TD = x_TD + self.mix(self.norm1(x_TD))
        return x_TD + self.ffn(self.norm2(x_TD))


class ToyMoE(nn.Module):
    """Embedding, MoE blocks, head; ``forward(ids_BS, num_items)`` is the summed next-token loss / ``num_items``."""

    def __init__(self, vocab: int = 64, dim: int = 16, width: int = 8, experts: int = 8, top_k: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(experts, top_k, dim, width) for _ in range(3))
        self.out = nn.Linear(dim, vocab, bias=False)

    def get_parallel_plan(self) -> ParallelPlan:
        """Experts sharded on dim 0 by EP; the embedding, each block and the head are FSDP units."""
        return ParallelPlan(
            ep_plan={"blocks.*.ffn.routed.w_in": Shard(0), "blocks.*.ffn.routed.w_out": Shard(0)},
            fsdp_units=("tok_emb", "blocks.*", "out"),
        )

    def forward(self, ids_BS: torch.Tensor, num_items: torch.Tensor | float) -> torch.Tensor:
        """Next-token cross-entropy summed over the batch, divided by ``num_items``."""
        x_TD = self.tok_emb(ids_BS[:, :-1]).flatten(0, 1)
        for block in self.blocks:
            x_TD = block(x_TD)
        return F.cross_entropy(self.out(x_TD).float(), ids_BS[:, 1:].flatten(), reduction="sum") / num_items


def full_grads(model: nn.Module, meshes: ParallelMeshes | None, info: EPInfo | None) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor (for the comparison only: it gathers everything on every rank)."""
    grads = {}
    for fqn, param in model.named_parameters():
        g = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad.clone()
        if meshes is not None and fqn in info.params:  # this EP rank's experts only: gather the others (dim 0)
            parts = [torch.empty_like(g) for _ in range(meshes.ep_size)]
            dist.all_gather(parts, g, group=meshes.ep.get_group())
            g = torch.cat(parts)
        grads[fqn] = g
    return grads


def main() -> None:
    p = argparse.ArgumentParser(description="EP + expert FSDP2 on a toy MoE with its own module names.")
    p.add_argument("--out", type=Path, required=True, help="torch.save of losses and first-step gradients")
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    torch.manual_seed(0)
    model = ToyMoE()  # materialised and identical on every rank (same seed); sharding slices it
    data_SBS = torch.randint(0, 64, (args.steps, 8, 12))  # per step: a global batch of 8 sequences of 12
    meshes, rank, world, info = None, 0, 1, None
    if "RANK" in os.environ:  # under torchrun: shard it
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        meshes = build_meshes(args.ep_size, device_type="cpu", ranks_per_node=args.ranks_per_node)
        info = apply_ep(model, model.get_parallel_plan(), meshes.ep)  # what EP did, handed to what needs it
        units = shard_model(model, meshes, ep_info=info)
        apply_schedule(build_schedule(units.stages, depth=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, grads = [], {}
    for step in range(args.steps):
        per_rank = data_SBS.shape[1] // world
        ids_BS = data_SBS[step, rank * per_rank : (rank + 1) * per_rank]
        # Every sequence has the same length here; num_items_for_global_mean also covers uneven counts.
        num_items = num_items_for_global_mean(ids_BS[:, 1:].numel())
        loss = model(ids_BS, num_items)
        loss.backward()
        if step == 0:
            grads = full_grads(model, meshes, info)
        clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if meshes is not None:  # each rank's loss is W * its share: the mean over ranks is the global loss
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(loss.item())
    if rank == 0:
        torch.save({"losses": losses, "grads": grads}, args.out)
        print("losses", " ".join(f"{x:.6f}" for x in losses))
    if meshes is not None:
        # Free the sharded model (its modules and hooks hold process groups, some in reference cycles) while the
        # groups exist, not at interpreter exit after them.
        del model, optimizer, units
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
