"""moeshard.ep: expert parallelism for MoE models.

FQN parallel plans and applying them (experts sharded on dim 0 over the EP group, kept as plain local
parameters), EP metadata, and the routed experts of one MoE layer: route (sort the token copies by expert) →
dispatch (to the EP rank of each copy's expert) → expert compute (one expert-MLP pass) → combine (weighted, in
float32). The strategy, kernel tier and GEMM backend are an :class:`EPOptions` passed to :func:`apply_ep`,
which gives every expert module that routes through ``self.dispatch`` its dispatcher: :class:`LocalDispatch`
(EP size 1), :class:`OverlappedDispatch` (the default for EP size > 1) or :class:`AllToAllDispatch` (the plain
reference). Nothing is set process-wide: two models in one process may use different options.

    from torch.distributed.tensor import Shard
    from moeshard.ep import EPOptions, ParallelPlan, apply_ep

    plan = ParallelPlan({"layers.*.experts.gate_up_proj": Shard(0), "layers.*.experts.down_proj": Shard(0)})
    info = apply_ep(model, plan, meshes.ep, EPOptions(kernels="triton"))  # meshes.ep or None for EP size 1
    # in the expert module:  y_TD = self.dispatch(x_TD, ids_TK, weights_TK, self.gate_up_proj, self.down_proj)
"""

from moeshard.ep._dispatch import (
    AllToAllDispatch,
    ExpertDispatch,
    HostSyncHooks,
    LocalDispatch,
    OverlappedDispatch,
    backward_elements,
    kept_factor_elements,
    recompute_contexts,
)
from moeshard.ep._kernels import ClampedSwiGLU, compile_rows_dynamic
from moeshard.ep._lowrank import LowRankDelta
from moeshard.ep._options import EPOptions
from moeshard.ep._plan import EPInfo, EPParamMeta, ParallelPlan, apply_ep, fqn_matches
from moeshard.ep._weight_grads import WeightGradFactors, WeightGradTarget, sum_weight_grads

__all__ = [
    "AllToAllDispatch",
    "ClampedSwiGLU",
    "EPInfo",
    "EPOptions",
    "EPParamMeta",
    "ExpertDispatch",
    "HostSyncHooks",
    "LocalDispatch",
    "LowRankDelta",
    "OverlappedDispatch",
    "ParallelPlan",
    "WeightGradFactors",
    "WeightGradTarget",
    "apply_ep",
    "backward_elements",
    "compile_rows_dynamic",
    "fqn_matches",
    "kept_factor_elements",
    "recompute_contexts",
    "sum_weight_grads",
]
