"""Communication estimates per optimizer step (for ``plan``): bytes per rank by collective kind and link.

Same convention as the measurement (:mod:`moeshard.train.observe.comm_accounting`): the bytes one rank sends to its peers,
counted per peer, so the share of peers on other nodes is the inter-node share. All-gather ``(n-1)·shard``,
reduce-scatter ``(n-1)/n·full``, all-to-all the rows sent to each peer. A test checks the all-gather and
reduce-scatter figures against the measured ones (``apps/train/tests/test_e2e.py``); the all-to-all depends on where the router sends
tokens, so it is given for uniform routing together with its upper bound (every token to every EP peer).
"""

from __future__ import annotations

import math
from typing import Any

from moeshard.train.families import family_of


def a2a_rows_per_token(config: Any, ep_size: int, uniform: bool = True) -> float:
    """Rows one token sends to the other EP ranks: each of its K routed copies whose expert lives elsewhere
    (every dispatch strategy of moeshard.ep sends copies). Expected value under uniform routing, or the upper
    bound (all K elsewhere)."""
    k, p = family_of(config).facts(config).top_k, ep_size
    return k * (p - 1) / p if uniform else float(k)


def estimate_comm_bytes(
    config: Any,
    *,
    world_size: int,
    ranks_per_node: int,
    ep_size: int,
    tokens_per_rank: int,
    micro_batches: int,
    compute_bytes: int,
    reshard_after_forward: bool,
    once_numel: int = 0,
    expert_reshard_after_forward: bool | None = None,
    expert_reduce_bytes: int = 4,
    activation_checkpointing: bool = False,
    reduce_every_micro_batch: bool = True,
    uniform_routing: bool = True,
    sp_size: int = 1,
    adapter_numel: tuple[float, float] | None = None,
) -> dict[tuple[str, str], float]:
    """Bytes leaving one rank per optimizer step, keyed by ``(kind, "intra-node" | "inter-node")``.

    Args:
        tokens_per_rank: tokens this rank processes per optimizer step (all micro-batches).
        micro_batches: gradient-accumulation steps; FSDP gathers and reduce-scatters once per micro-batch.
        compute_bytes: bytes per element of the gathered parameters and the exchanged activations.
        reshard_after_forward: units are gathered again in backward, except the ``once_numel`` parameters of units
            never resharded after forward (FSDP2's root; the head, which backward needs first), gathered once per
            micro-batch.
        expert_reshard_after_forward: the same for the expert units (None: ``reshard_after_forward``); False
            gathers them once per micro-batch.
        expert_reduce_bytes: bytes per element of the experts' reduce-scatter (2 with
            ``parallel.expert_reduce_dtype: bfloat16``).
        activation_checkpointing: the recomputed forward sends the tokens' hidden states to their experts again
            (full checkpointing; the recompute brings no outputs back, moeshard-ep's ``discard_outputs``).
        reduce_every_micro_batch: FSDP reduce-scatters after every micro-batch (False: once per step,
            ``train.gradient_sync: last_micro_batch``).
        uniform_routing: False gives the all-to-all upper bound (every token to every EP peer).
        sp_size: ranks sharing each row (sequence parallelism): each attention's q, k, v go to head shards and its
            output comes back, forward and backward (and again in full checkpointing's recompute), each rank
            sending ``(sp-1)/sp`` of them inside its node (``sp_all_to_all``); key/value heads replicated to
            ``lcm(G, sp)`` where fewer than ``sp``.
        adapter_numel: LoRA: the adapters' unsharded elements ``(outside the experts, this EP rank's experts')``.
            They are gathered beside the frozen base and are the only gradients reduce-scattered (the base has
            none); None: no adapters, every parameter trains.

    all-to-all per MoE layer and token: the token's hidden state out and its partial output back, in forward and
    backward (4 passes; 5 with activation checkpointing, whose recompute sends the hidden states out again), plus
    the per-expert row counts (int64) of each forward (the recompute replays them).
    Reduce-scatter is float32, the experts' ``expert_reduce_bytes`` per element.
    """
    facts = family_of(config).facts(config)
    d, moe_layers = facts.hidden_size, facts.moe_layers
    ep_fsdp = world_size // ep_size
    nodes = world_size // ranks_per_node
    out: dict[tuple[str, str], float] = {}

    def add(kind: str, total: float, group: int, group_nodes: int) -> None:
        if group <= 1 or total == 0:
            return
        peers = group - 1
        inter = 0.0 if group_nodes <= 1 else (group - group // group_nodes) / peers
        for link, share in (("intra-node", 1 - inter), ("inter-node", inter)):
            if share > 0:
                out[(kind, link)] = out.get((kind, link), 0.0) + total * share

    rows = a2a_rows_per_token(config, ep_size, uniform_routing)
    passes = 5 if activation_checkpointing else 4  # hidden states out + partial outputs back, fwd + bwd; AC: out again
    per_row = passes * d * compute_bytes
    counts = (ep_size - 1) * (facts.num_experts // ep_size) * 8  # per layer and forward: rows per expert (int64)
    a2a = moe_layers * (tokens_per_rank * rows * per_row + micro_batches * counts)
    ep_nodes = -(-ep_size // ranks_per_node) if ep_size > ranks_per_node else 1
    add("all_to_all", a2a, ep_size, ep_nodes)

    expert_numel = moe_layers * facts.num_experts * 3 * d * facts.expert_width
    dense_numel = facts.parameters - expert_numel
    gathers = 2 if reshard_after_forward else 1
    expert_reshard = reshard_after_forward if expert_reshard_after_forward is None else expert_reshard_after_forward
    ep_fsdp_nodes = min(nodes, ep_fsdp)
    dense_adapters, expert_adapters = adapter_numel if adapter_numel is not None else (0.0, 0.0)
    for numel, reduced, root, group, group_nodes, unit_gathers, reduce_bytes in (
        (dense_numel + dense_adapters, dense_adapters, once_numel, world_size, nodes, gathers, 4),
        (
            expert_numel / ep_size + expert_adapters,
            expert_adapters,
            0,
            ep_fsdp,
            ep_fsdp_nodes,
            2 if expert_reshard else 1,
            expert_reduce_bytes,
        ),
    ):
        gathered = micro_batches * (unit_gathers * (numel - root) + root)
        add("all_gather", gathered * compute_bytes * (group - 1) / group, group, group_nodes)
        reductions = micro_batches if reduce_every_micro_batch else 1
        reduced = reduced if adapter_numel is not None else numel  # only what trains has a gradient
        add("reduce_scatter", reductions * reduced * reduce_bytes * (group - 1) / group, group, group_nodes)
    if sp_size > 1:
        h = facts.attention_heads
        g = getattr(config, "num_key_value_heads", None) or h
        g = math.lcm(g, sp_size)  # the key/value heads exchanged, replicated where fewer than sp
        # attention_width = Σ_layers H·(Dqk + Dv): q and the output; k and v carry G of the H heads' widths
        per_token = facts.attention_width * (1 + g / h) * compute_bytes * (sp_size - 1) / sp_size
        passes = 3 if activation_checkpointing else 2
        add("sp_all_to_all", passes * tokens_per_rank * per_token, sp_size, 1)
    return out
