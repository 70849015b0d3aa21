"""EP size 1: every expert is local, nothing travels.

Flow: sort the N = T*K token copies by expert (stable), one expert-MLP pass over them (grouped GEMM or the
per-expert loop) that applies their routing weights, un-sort and add each token's K copies in float32. No
device→host sync with the grouped_mm backend; the loop backend reads the per-expert counts on the host (one
``.tolist()``). The host-sync hooks never run here (there is no exchange to size).
"""

from __future__ import annotations

import torch

from moeshard.ep._dispatch._base import ExpertDispatch
from moeshard.ep._expert_pass import NO_BIASES
from moeshard.ep._lowrank import NO_DELTAS
from moeshard.ep._mlp import grouped_expert_mlp

__all__ = ["LocalDispatch"]


class LocalDispatch(ExpertDispatch):
    """The routed experts of one MoE layer with all experts on this rank (EP size 1)."""

    distributed = False

    def run_experts(
        self,
        x_sorted_ND,
        w_sorted_N,
        counts_E,
        w_gate_up_EXD,
        w_down_EDF,
        activation,
        deltas=NO_DELTAS,
        biases=NO_BIASES,
    ) -> torch.Tensor:
        """The copies through the local experts' MLP (see :meth:`ExpertDispatch.run_experts`)."""
        return grouped_expert_mlp(
            x_sorted_ND,
            counts_E,
            w_gate_up_EXD,
            w_down_EDF,
            activation=activation,
            gemm=self.options.gemm,
            kernels=self.options.kernels,
            recompute=self.options.recompute,
            weight_grads=self.weight_grads,
            row_weights=w_sorted_N,
            deltas=deltas,
            biases=biases,
            output=not self.outputs_discarded,
        )

    def _check_expert_count(self, El: int) -> None:
        if El != self.num_experts:
            raise ValueError(
                f"the expert weights hold {El} of {self.num_experts} experts but this layer has no EP group "
                "(LocalDispatch): weights sliced to one EP rank (by moeshard.ep.apply_ep, or a model loaded with "
                "expert_range) run only through the EP dispatch apply_ep installs; for training build the model "
                "on meta, apply_ep, then load the weights"
            )
