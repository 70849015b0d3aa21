"""The experts' load: how many routed copies each expert of each MoE layer got, per micro-batch
(:func:`expert_counts`) and over a step's micro-batches and ranks (:class:`GlobalExpertCounts`), on the device.

Legend: T tokens, B rows, S tokens per row, K top-k, E experts, L MoE layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.models.common._moe import Router
from moeshard.models.common._weighted_counts import weighted_counts

__all__ = ["GlobalExpertCounts", "expert_counts"]


@torch.no_grad()
def expert_counts(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    top_k: int,
    biases: list[torch.Tensor | None] | None = None,
    attention_mask_BS: torch.Tensor | None = None,
    routers: list[Router] | None = None,
    router_ids: tuple[torch.Tensor, ...] | list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Tokens routed to each expert of each MoE layer: float32 ``[L, E]`` (each token counts once per selected
    expert; padding left out when ``attention_mask_BS`` is given). No host sync: sum it over micro-batches and
    all-reduce it over ranks for the global load of a step.

    The selection: ``router_ids`` (one ``[T, K]`` tensor per layer: the experts the routers selected as the tokens
    were routed, the model output's ``router_ids``), counted as they are; else with ``routers`` (one per layer,
    :func:`routers`), each router's own selected again (``select_ids``: its scores, selection bias and groups, e.g.
    DeepSeek-V3's); else the softmax top-k of the logits plus ``biases`` (each layer's selection bias or None),
    Qwen3-MoE's."""
    if router_ids is not None:
        return _count_ids(router_ids, router_logits[0].shape[-1], attention_mask_BS)
    rows = []
    for i, logits_TE in enumerate(router_logits):
        if routers is not None:
            ids_TK = routers[i].select_ids(logits_TE)
        else:
            probs_TE = torch.softmax(logits_TE.detach(), dim=-1, dtype=torch.float32)
            bias = biases[i] if biases is not None else None
            ids_TK = torch.topk(probs_TE if bias is None else probs_TE + bias, top_k, dim=-1).indices
        weight_TK = torch.ones_like(ids_TK, dtype=torch.float32)
        if attention_mask_BS is not None:
            weight_TK = weight_TK * attention_mask_BS.reshape(-1, 1).to(weight_TK)
        rows.append(
            torch.zeros(logits_TE.shape[-1], device=logits_TE.device).scatter_add_(
                0, ids_TK.flatten(), weight_TK.flatten()
            )
        )
    return torch.stack(rows)


def _count_ids(
    ids: tuple[torch.Tensor, ...] | list[torch.Tensor], num_experts: int, attention_mask_BS: torch.Tensor | None
) -> torch.Tensor:
    """``[L, E]`` float32 counts of the layers' ``[T, K]`` expert ids in one scatter (layer l's ids offset by l·E)."""
    ids_LTK = torch.stack(list(ids))
    n_layers, device = ids_LTK.shape[0], ids_LTK.device
    offsets_L11 = torch.arange(n_layers, device=device).view(-1, 1, 1) * num_experts
    if attention_mask_BS is None:
        weight_LTK = torch.ones(ids_LTK.shape, dtype=torch.float32, device=device)
    else:
        mask_1T1 = attention_mask_BS.reshape(1, -1, 1).to(device, torch.float32)
        weight_LTK = mask_1T1.expand(ids_LTK.shape)
    counts = weighted_counts((ids_LTK + offsets_L11).reshape(-1), weight_LTK.reshape(-1), n_layers * num_experts)
    return counts.view(n_layers, num_experts)


class GlobalExpertCounts:
    """A step's expert counts summed over its micro-batches and over the ranks of ``group``, on the device.

    The counts are :func:`expert_counts`' ``[L, E]`` float32, added micro-batch by micro-batch (no host sync).

    - Global-batch balancing loss: ``add(counts, all_reduce=True)`` all-reduces each micro-batch's counts at once
      (one all-reduce of ``[L, E]``) and returns the running sum: micro-batch ``m`` of a step sees the counts of
      micro-batches ``1..m`` of that step on every rank. Pass it to :func:`global_balancing_loss`. This is the
      running form of a global-batch loss (Megatron-LM's ``global_aux_loss`` keeps the same running sum): the
      last micro-batch sees the whole step's counts, the first only its own micro-batch on all ranks.
    - Otherwise ``add(counts)`` keeps them on this rank, and :meth:`total` all-reduces them once per step.

    :meth:`total` gives the step's global counts, identical on every rank (for the load metrics and
    :func:`update_router_bias`); :meth:`reset` starts the next step. Without a process group nothing is
    communicated (one rank's counts are the global ones).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._reduced_LE: torch.Tensor | None = None  # summed over the ranks already
        self._local_LE: torch.Tensor | None = None  # this rank's, not yet reduced

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def reset(self) -> None:
        """Forget the counts (a new step)."""
        self._reduced_LE = self._local_LE = None

    def add(self, counts_LE: torch.Tensor, *, all_reduce: bool = False) -> torch.Tensor:
        """Add one micro-batch's counts of this rank.

        Args:
            all_reduce: sum them over the ranks now (every rank must call it alike, once per micro-batch).

        Returns:
            With ``all_reduce``, the running global counts of the step's micro-batches so far (all ranks); else this
            rank's counts so far plus what was reduced already.
        """
        counts_LE = counts_LE.detach().float()
        if all_reduce:
            reduced = self._all_reduce(counts_LE.clone())
            self._reduced_LE = reduced if self._reduced_LE is None else self._reduced_LE + reduced
            return self._reduced_LE if self._local_LE is None else self._reduced_LE + self._local_LE
        self._local_LE = counts_LE.clone() if self._local_LE is None else self._local_LE + counts_LE
        return self._local_LE if self._reduced_LE is None else self._reduced_LE + self._local_LE

    def total(self) -> torch.Tensor | None:
        """The step's counts over all micro-batches and ranks (one all-reduce of the local part, if any; every rank
        must call it alike), or None when nothing was added."""
        if self._local_LE is not None:
            local = self._all_reduce(self._local_LE)
            self._reduced_LE = local if self._reduced_LE is None else self._reduced_LE + local
            self._local_LE = None
        return self._reduced_LE
