"""Communication estimates per optimizer step (for ``plan``): bytes per rank by collective kind and link."""

from __future__ import annotations

from typing import Any


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
) -> dict[tuple[str, str], float]:
    """Bytes leaving one rank per optimizer step, keyed by ``(kind, "intra-node" | "inter-node")``.

    all-to-all: 4 passes per MoE layer (dispatch and combine, forward and backward) of the routed token copies
    that go to the other ``ep_size - 1`` ranks of the EP group (uniform routing assumed). all-gather: each
    parameter once per micro-batch in forward, again in backward when resharded after forward (compute dtype).
    reduce-scatter: fp32 gradients once per micro-batch. A group's traffic is inter-node for the share of peers
    on other nodes.
    """
    d = config.hidden_size
    moe_layers = sum(
        1
        for i in range(config.num_hidden_layers)
        if i not in set(config.mlp_only_layers or []) and (i + 1) % (config.decoder_sparse_step or 1) == 0
    )
    ep_fsdp = world_size // ep_size
    nodes = world_size // ranks_per_node
    out: dict[tuple[str, str], float] = {}

    def add(kind: str, total: float, group: int, group_nodes: int) -> None:
        if group <= 1 or total == 0:
            return
        peers = group - 1
        inter = 0 if group_nodes <= 1 else (group - group // group_nodes) / peers
        for link, share in (("intra-node", 1 - inter), ("inter-node", inter)):
            if share > 0:
                out[(kind, link)] = out.get((kind, link), 0.0) + total * share

    a2a = 4 * moe_layers * tokens_per_rank * config.num_experts_per_tok * d * compute_bytes * (ep_size - 1) / ep_size
    ep_nodes = max(1, ep_size // ranks_per_node) if ep_size > ranks_per_node else 1
    add("all_to_all", a2a, ep_size, ep_nodes)
    expert_numel = moe_layers * config.num_experts * 3 * d * config.moe_intermediate_size
    total_numel = _total_numel(config)
    dense_numel = total_numel - expert_numel
    gathers = micro_batches * (2 if reshard_after_forward else 1)
    ep_fsdp_nodes = min(nodes, ep_fsdp)
    for numel, group, group_nodes in (
        (dense_numel, world_size, nodes),
        (expert_numel / ep_size, ep_fsdp, ep_fsdp_nodes),
    ):
        add("all_gather", gathers * numel * compute_bytes * (group - 1) / group, group, group_nodes)
        add("reduce_scatter", micro_batches * numel * 4 * (group - 1) / group, group, group_nodes)
    return out


def _total_numel(config: Any) -> int:
    from moeshard.models.qwen3moe import count_parameters

    return int(count_parameters(config)[0])
