"""moeshard.ep: expert parallelism for MoE models.

FQN parallel plans and applying them (experts sharded on dim 0 over the EP group, kept as plain local
parameters), EP metadata, and the routed-experts computation of one MoE layer: token dispatch and combine with
all-to-all over the EP group around one grouped GEMM of the local experts. EP size 1 is the same code path
with no communication.

    from torch.distributed.tensor import Shard
    from moeshard.ep import ParallelPlan, apply_ep, ep_group, routed_experts

    plan = ParallelPlan({"layers.*.experts.gate_up_proj": Shard(0), "layers.*.experts.down_proj": Shard(0)})
    info = apply_ep(model, plan, meshes.ep)          # or None for EP size 1
    experts = model.layers[0].experts                # in the MoE layer's forward:
    y_TD = routed_experts(x_TD, ids_TK, weights_TK, experts.gate_up_proj, experts.down_proj,
                          num_experts=E, ep_group=ep_group(experts))
"""

from moeshard.ep._dispatch import (
    Dispatch,
    all_to_all,
    get_ep_dispatch,
    register_host_sync_hook,
    routed_experts,
    set_compiled_kernels,
    set_ep_dispatch,
)
from moeshard.ep._grouped import (
    ACTIVATIONS,
    Backend,
    get_grouped_mm_backend,
    grouped_expert_mlp,
    set_grouped_mm_backend,
)
from moeshard.ep._plan import (
    EPInfo,
    EPParamMeta,
    ParallelPlan,
    apply_ep,
    ep_group,
    find_expert_modules,
    fqn_matches,
    get_ep_info,
    is_expert_module,
)

__all__ = [
    "Dispatch",
    "ACTIVATIONS",
    "Backend",
    "EPInfo",
    "EPParamMeta",
    "ParallelPlan",
    "all_to_all",
    "apply_ep",
    "ep_group",
    "find_expert_modules",
    "fqn_matches",
    "get_ep_info",
    "get_ep_dispatch",
    "get_grouped_mm_backend",
    "grouped_expert_mlp",
    "is_expert_module",
    "register_host_sync_hook",
    "routed_experts",
    "set_compiled_kernels",
    "set_ep_dispatch",
    "set_grouped_mm_backend",
]
