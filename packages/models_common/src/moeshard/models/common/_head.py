"""The output side of the causal LM: :class:`LMHead` (logits, or the chunked loss given targets),
:func:`causal_lm_loss` (the loss from logits, transformers' semantics) and :class:`CausalLMOutput`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeshard.models.common._lm_loss import IGNORE_INDEX, ce_chunk, linear_cross_entropy

__all__ = ["CausalLMOutput", "LMHead", "LMHeadOptions", "causal_lm_loss"]


@dataclass
class CausalLMOutput:
    """What ``MoECausalLM.forward`` returns.

    Attributes:
        loss: transformers' total: ``lm_loss`` plus ``router_aux_loss_coef * aux_loss`` when router logits are
            output, or None without labels. Training loops use ``lm_loss`` and ``aux_loss`` (and their own
            balancing coefficients, see :class:`moeshard.models.common.Balancing`), never this sum.
        aux_loss: the load-balancing loss (unscaled), or None when router logits are not output.
        logits: ``[B, S, V]`` in the model's dtype.
        router_logits: one ``[B·S, E]`` tensor per MoE layer when output, else None.
        lm_loss: the language-model loss alone, or None without labels.
        router_ids: with ``router_logits``, one ``[B·S, K]`` tensor per MoE layer: the experts its router selected
            for each token (bias and groups included), the selection the tokens were routed by.
    """

    loss: torch.Tensor | None
    aux_loss: torch.Tensor | None
    logits: torch.Tensor
    router_logits: tuple[torch.Tensor, ...] | None = None
    lm_loss: torch.Tensor | None = None
    router_ids: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class LMHeadOptions:
    """How an :class:`LMHead` computes its chunked loss (:func:`linear_cross_entropy`); the numbers are the same.

    Attributes:
        chunk_loss: the function of one chunk's loss and logit gradient: ``ce_chunk``, or what ``parallelize``
            gives (compiled, or the Triton kernel of the ``"triton"`` tier).
        grad_target: None, or the head's ``moeshard.fsdp_moe.reduced_grad_target`` (``parallelize`` gives it):
            the weight's float32 gradient goes from the loss path to FSDP2.
    """

    chunk_loss: Callable = ce_chunk
    grad_target: Callable | None = None


class LMHead(nn.Linear):
    """The output projection; given next-token targets it returns the loss instead of logits (chunked, see
    :func:`linear_cross_entropy`). A module of its own so that FSDP's hooks
    gather its weight in both cases; its parameter name stays ``lm_head.weight``.

    ``options`` (an :class:`LMHeadOptions`, the defaults until ``parallelize`` replaces it whole) says how the loss
    is computed.
    """

    options: LMHeadOptions = LMHeadOptions()
    lora_refusal: str = (
        "the LM head computes the loss from its weight in chunks, where a forward hook's term would be left out; "
        "adapt the attention, mixer and expert projections instead (lora.target_modules, lora.target_parameters)"
    )
    """Read by ``moeshard.lora``: why this linear module takes no adapter."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(  # noqa: D102
        self,
        x_BSD: torch.Tensor,
        targets_BS: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        if targets_BS is None:
            return super().forward(x_BSD)
        return linear_cross_entropy(
            x_BSD.reshape(-1, x_BSD.shape[-1]),
            self.weight,
            targets_BS.reshape(-1),
            num_items_in_batch,
            chunk_loss=self.options.chunk_loss,
            grad_target=self.options.grad_target,
        )


def causal_lm_loss(
    logits_BSV: torch.Tensor,
    labels_BS: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    shifted: bool = False,
) -> torch.Tensor:
    """Next-token cross-entropy in float32, labels shifted inside, ``-100`` ignored (transformers semantics).

    Mean over label tokens, or their sum divided by ``num_items_in_batch`` when it is given. ``shifted``: the labels
    are already the targets (position t predicts ``labels[t]``; a sequence-parallel shard's).
    """
    shift_labels_BS = labels_BS if shifted else F.pad(labels_BS, (0, 1), value=IGNORE_INDEX)[..., 1:]
    logits_NV = logits_BSV.float().reshape(-1, logits_BSV.shape[-1])
    targets_N = shift_labels_BS.reshape(-1).to(logits_NV.device)
    if num_items_in_batch is None:
        return F.cross_entropy(logits_NV, targets_N, ignore_index=IGNORE_INDEX)
    loss = F.cross_entropy(logits_NV, targets_N, ignore_index=IGNORE_INDEX, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
