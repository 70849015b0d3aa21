"""DeepSeek-V3's complementary sequence-wise balance loss (the ``sequence`` scope of ``BalancingOptions``).

Legend: T tokens, B rows (sequences) of a micro-batch, S tokens per row, K top-k, E experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeshard.models.common._moe import Router
from moeshard.models.common._torch_internals import all_reduce_sum

__all__ = ["sequence_balancing_loss", "sequence_rows"]


def sequence_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    routers: list[Router],
    top_k: int,
    rows: int,
    attention_mask_BS: torch.Tensor | None = None,
    router_ids: tuple[torch.Tensor, ...] | list[torch.Tensor] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (its report's section 2.1.2), float32, not multiplied
    by its coefficient: ``mean_l mean_b Σ_e f_lbe · P_lbe`` over the MoE layers ``l`` and the micro-batch's rows ``b``.

    A row is one sequence (packed documents in one row are one). With ``T_b`` the row's tokens (padding left out
    when ``attention_mask_BS`` is given; a row of padding only is left out of the mean):

    - ``f_lbe = E / (K · T_b) · #{t in b: e among t's selected experts}``: the router's own selection
      (:meth:`Router.select_ids`: selection bias and groups included), no gradient;
    - ``P_lbe = 1 / T_b · Σ_t s'_te`` with ``s'`` the router's normalised affinities (:meth:`Router.affinities`:
      softmax probabilities, or sigmoid scores divided by their sum over the experts); the gradient flows here.

    An evenly balanced row gives 1. The result is this rank's own: no communication, except with ``group`` (a
    sequence group, each rank holding a shard of every row): the rows' counts, probabilities and tokens are then
    summed over it before the product, so each row is the whole row.

    Args:
        router_logits: one ``[B·S, E]`` tensor per MoE layer, rows first (the model's ``router_logits``).
        routers: one router per MoE layer, in the same order (:func:`routers`).
        top_k: K, experts per token.
        rows: B.
        attention_mask_BS: 1 for tokens, 0 for padding, or None.
        router_ids: one ``[B·S, K]`` tensor per MoE layer, the experts the routers selected as the tokens were
            routed (the model output's ``router_ids``); None selects again (``select_ids``).

    Raises:
        ValueError: the logits' tokens do not split into ``rows`` rows, or the routers are not one per layer.
    """
    if len(routers) != len(router_logits):
        raise ValueError(f"{len(router_logits)} layers of router logits but {len(routers)} routers")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if router_ids is not None and len(router_ids) != len(router_logits):
        raise ValueError(f"{len(router_logits)} layers of router logits but {len(router_ids)} of router ids")
    losses = []
    for i, (router, logits_TE) in enumerate(zip(routers, router_logits)):
        t, e = logits_TE.shape
        if t % rows:
            raise ValueError(f"router logits of {t} tokens do not split into {rows} rows")
        s = t // rows
        probs_BSE = router.affinities(logits_TE).view(rows, s, e)
        chosen_TE = torch.zeros(t, e, device=logits_TE.device, dtype=torch.float32)
        ids_TK = router.select_ids(logits_TE) if router_ids is None else router_ids[i]
        chosen_BSE = chosen_TE.scatter_(1, ids_TK, 1.0).view(rows, s, e)
        if attention_mask_BS is None:
            tokens_B = torch.full((rows,), float(s), device=logits_TE.device)
        else:
            w_BS1 = attention_mask_BS.reshape(rows, s, 1).to(logits_TE.device, torch.float32)
            probs_BSE, chosen_BSE = probs_BSE * w_BS1, chosen_BSE * w_BS1
            tokens_B = w_BS1.sum(dim=(1, 2))
        chosen_BE, probs_BE = chosen_BSE.sum(1), probs_BSE.sum(1)
        if group is not None:
            for t in (chosen_BE, tokens_B):  # no gradient: plain sums
                dist.all_reduce(t, group=group)
            probs_BE = all_reduce_sum(probs_BE, group=group)  # the backward sums the group's gradients
        n_B1 = tokens_B.clamp_min(1.0)[:, None]
        f_BE = chosen_BE * (e / top_k) / n_B1
        p_BE = probs_BE / n_B1
        keep_B = (tokens_B > 0).float()
        losses.append(((f_BE * p_BE).sum(-1) * keep_B).sum() / keep_B.sum().clamp_min(1.0))
    return torch.stack(losses).mean()


def sequence_rows(attention_mask_BS: torch.Tensor | None, rows: int | None) -> int:
    """The micro-batch's rows for the ``sequence`` scope: the mask's, or ``rows``."""
    if attention_mask_BS is None:
        if rows is None:
            raise ValueError(
                "BalancingOptions.scope='sequence' needs the micro-batch's rows: pass its attention mask, or "
                "micro_batch_loss(out, rows=B) with B its sequences"
            )
        return rows
    if rows is not None and rows != attention_mask_BS.shape[0]:
        raise ValueError(f"rows={rows} but the attention mask has {attention_mask_BS.shape[0]} rows")
    return attention_mask_BS.shape[0]
