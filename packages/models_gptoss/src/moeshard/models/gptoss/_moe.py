"""GPT-OSS's MoE block: a biased linear router (top-k of the logits, softmax over those k) and experts with biases
and the clamped SwiGLU (``moeshard.ep.ClampedSwiGLU``), computed by ``moeshard.ep``'s dispatchers.

Legend: T tokens, K top-k, D hidden, E experts (local to this EP rank in parameter shapes), F expert width.
Parameters in our layout: ``gate_up_proj [E, 2F, D]`` (gate rows, then up rows), ``gate_up_proj_bias [E, 2F]``,
``down_proj [E, D, F]``, ``down_proj_bias [E, D]``; the Hub's (``[E, D, 2F]`` with gate and up interleaved,
``[E, F, D]``) are converted on load and save (``_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GptOssConfig

from moeshard.ep import ClampedSwiGLU
from moeshard.models.common import Experts, MoEBlock, Router

__all__ = ["GptOssExperts", "GptOssMoE", "GptOssRouter"]


class GptOssRouter(Router):
    """``logits = x Wᵀ + b``; the top-k logits, softmax over those k (in the logits' dtype), as transformers'
    ``GptOssTopKRouter``. ``selection`` (None until :meth:`enable_bias`): a float32 ``[E]`` buffer added to the
    logits for the top-k *selection* only (aux-loss-free balancing); the weights stay the unbiased logits'."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.selection: torch.Tensor | None = None

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """``selection``."""
        return self.selection

    def enable_bias(self) -> None:
        """Register ``selection`` (zeros, float32) if it is not there yet."""
        if self.selection is None:
            del self.selection
            self.register_buffer("selection", torch.zeros(self.weight.shape[0], device=self.weight.device))

    @torch.no_grad()
    def select_ids(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``ids_TK``: the top-k of the logits (plus the selection bias)."""
        scores = logits_TE.detach().float()
        if self.selection is not None:
            scores = scores + self.selection
        return torch.topk(scores, self.top_k, dim=-1)[1]

    def affinities(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """The float32 softmax over every expert (what the load-balancing losses average)."""
        return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for the weight and a zero bias, as transformers."""
        nn.init.normal_(self.weight, mean=0.0, std=std, generator=generator)
        nn.init.zeros_(self.bias)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits_TE, topk_weights_TK, topk_ids_TK)``."""
        logits_TE = F.linear(x_TD, self.weight, self.bias)
        if self.selection is None:
            top_TK, ids_TK = torch.topk(logits_TE, self.top_k, dim=-1)
        else:
            ids_TK = self.select_ids(logits_TE)
            top_TK = logits_TE.gather(-1, ids_TK)
        return logits_TE, torch.softmax(top_TK, dim=-1, dtype=top_TK.dtype), ids_TK


class GptOssExperts(Experts):
    """:class:`moeshard.models.common.Experts` with GPT-OSS's biases and activation (the EP plan shards the biases
    on dim 0 with the weights)."""

    def __init__(self, num_experts: int, hidden_size: int, width: int, activation: ClampedSwiGLU) -> None:
        super().__init__(num_experts, hidden_size, width)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * width))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.activation = activation

    def init_weights_(self, std: float, generator: torch.Generator | None = None) -> None:
        """normal(0, std) for the weights, zero biases, as transformers."""
        super().init_weights_(std, generator)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
        """``y_TD``: each token's routed experts' outputs (with their biases and, where ``moeshard.lora`` added
        them, the weights' adapters), weighted by ``topk_weights_TK``."""
        return self.dispatch(
            x_TD,
            topk_ids_TK,
            topk_weights_TK,
            self.gate_up_proj,
            self.down_proj,
            activation=self.activation,
            biases=(self.gate_up_proj_bias, self.down_proj_bias),
            deltas=(self._low_rank("gate_up_proj"), self._low_rank("down_proj")),
        )


class GptOssMoE(MoEBlock):
    """Experts then router, registered as transformers' ``GptOssMLP`` names them (``experts``, ``router``)."""

    def __init__(self, config: GptOssConfig) -> None:
        nn.Module.__init__(self)
        alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.experts = GptOssExperts(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            ClampedSwiGLU(alpha=alpha, limit=float(config.swiglu_limit)),
        )
        self.router = GptOssRouter(config.num_local_experts, config.hidden_size, config.num_experts_per_tok)
        # no shared experts: MoEBlock's fields as its __init__ (not run, for transformers' registration order) sets them
        self.shared_name, self.shared_gated = None, False

    @property
    def gate(self) -> GptOssRouter:
        """The router under the name every other family's block gives it (``moeshard.models.common``'s facts)."""
        return self.router

    def route(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's ``(logits_TE, topk_weights_TK, topk_ids_TK)`` for the block's input, T = B·S."""
        return self.router(x_BSD.reshape(-1, x_BSD.shape[-1]))
