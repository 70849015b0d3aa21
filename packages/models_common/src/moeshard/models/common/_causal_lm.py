"""The causal LM every family is: decoder stack, LM and load-balancing losses, init, parallel plan, HF load/save.

A family subclasses :class:`DecoderModel` (``build_layer``: its attention and MLP per layer) and
:class:`MoECausalLM` (``base_model_class``, ``hf_format``); everything else is here, once. Plain PyTorch: runs alone
on one device with no process group. Parallelism and compilation are applied from outside by :func:`parallelize`
(EP installs each layer's expert dispatcher, which does the token all-to-all; nothing here changes).
``get_parallel_plan`` is the only place the model says anything about parallelism.

    model = Qwen3MoeForCausalLM.from_pretrained("/ckpt/Qwen3-30B-A3B", dtype=torch.bfloat16)   # any family
    out = model(input_ids, labels=input_ids)          # out.loss, out.lm_loss, out.aux_loss, out.logits

    with torch.device("meta"):                        # sharded training: build, parallelise, then fill
        model = DeepseekV3ForCausalLM(get_preset_config("deepseek-v3-16b"))
    par = parallelize(model, meshes, ParallelOptions(compile=True))
    model.to_empty(device="cuda")
    load_hf_weights(model, "/ckpt/...", ep_info=par.ep_info)  # or model.init_weights()
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard
from torch.nn.attention.flex_attention import BlockMask
from transformers import PretrainedConfig

from moeshard.ep import ParallelPlan
from moeshard.models.common._balancing import load_balancing_loss
from moeshard.models.common._delta_rule import RowSegments
from moeshard.models.common._fa4 import fa4_unavailable
from moeshard.models.common._head import CausalLMOutput, LMHead, causal_lm_loss
from moeshard.models.common._hf_load import HFFormat
from moeshard.models.common._kept import AttentionOptions
from moeshard.models.common._layers import (
    DenseMLP,
    RMSNorm,
    RotaryEmbedding,
    TokenEmbedding,
    build_attention_mask,
    document_block_mask,
    document_causal_mask,
)
from moeshard.models.common._lm_loss import IGNORE_INDEX
from moeshard.models.common._moe import Experts, MoEBlock, routers
from moeshard.models.common._sequence_layout import SequenceLayout

__all__ = ["DecoderLayer", "DecoderModel", "LayerExecution", "MoECausalLM", "SequenceLayout"]


@dataclass(frozen=True)
class LayerExecution:
    """How a :class:`DecoderLayer` runs; what it computes is the same.

    Attributes:
        attention_half: a compiled :meth:`DecoderLayer.attention_half` of the layer (``parallelize(compile=True)``:
            ``torch.compile`` of the bound method, so every layer shares one graph), run in its place; None: eager.
        checkpoint: ``checkpoint(forward, *args)`` runs the layer's forward under activation checkpointing
            (``apply_activation_checkpointing``); None: plainly.
    """

    attention_half: Callable | None = None
    checkpoint: Callable | None = None


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``self_attn(x_BSD, cos, sin, mask, attention) -> y_BSD`` (``attention``: the model's :class:`AttentionOptions`,
    resolved for the device; None: the defaults); ``mlp(h_BSD)`` returns ``y_BSD`` (dense) or
    ``(y_BSD, router_logits_TE)`` (MoE). Every family builds its layers from its own attention and MLP modules.

    The sequence mixer (attention, or another kind such as a linear attention) sits under ``mixer_name``
    (``"self_attn"``; checkpoints name it, e.g. ``"linear_attn"``) and is :attr:`mixer` whatever its name; its
    class's ``mask_kind`` (default ``"attention"``) says which mask the decoder gives it: the attention mask, or
    ``"segments"``, the row's :class:`RowSegments`. ``norm_class`` is the kind of the two norms.

    ``execution`` (a :class:`LayerExecution`, replaced whole by ``parallelize`` and
    ``apply_activation_checkpointing``) says whether the attention half runs compiled and the forward checkpointed.
    """

    execution: LayerExecution = LayerExecution()

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        layer_idx: int,
        *,
        mixer_name: str = "self_attn",
        norm_class: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_name = mixer_name
        self.add_module(mixer_name, self_attn)
        self.mlp = mlp
        self.input_layernorm = norm_class(hidden_size, eps)
        self.post_attention_layernorm = norm_class(hidden_size, eps)

    @property
    def mixer(self) -> nn.Module:
        """The layer's sequence mixer (``self_attn``, or the module under its ``mixer_name``)."""
        return getattr(self, self.mixer_name)

    def attention_half(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor,
        sin_BSDh: torch.Tensor,
        mask_B1SS: torch.Tensor | None,
        attention: AttentionOptions | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The layer up to the routed experts: ``(x + attn(input_norm(x)), h = post_attention_norm(of that), the
        MoE block's routing of h)``; the routing (``MoEBlock.route``: logits, weights, ids) is None for a dense MLP.

        Compiled from outside as one graph (``parallelize``: ``torch.compile(layer.attention_half)``, which
        :attr:`execution` holds and :meth:`forward` runs), the router inside it; the routed experts after it stay
        eager (they sync with the host under EP).
        """
        x_BSD = x_BSD + self.mixer(self.input_layernorm(x_BSD), cos_BSDh, sin_BSDh, mask_B1SS, attention)
        h_BSD = self.post_attention_layernorm(x_BSD)
        return x_BSD, h_BSD, self.mlp.route(h_BSD) if isinstance(self.mlp, MoEBlock) else None

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor,
        sin_BSDh: torch.Tensor,
        mask_B1SS: torch.Tensor | None,
        attention: AttentionOptions | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(x_BSD, (router_logits_TE, topk_ids_TK) or None for a dense layer)``: the ids that routed the tokens."""
        if self.execution.checkpoint is not None:
            return self.execution.checkpoint(self._forward, x_BSD, cos_BSDh, sin_BSDh, mask_B1SS, attention)
        return self._forward(x_BSD, cos_BSDh, sin_BSDh, mask_B1SS, attention)

    def _forward(
        self,
        x_BSD: torch.Tensor,
        cos_BSDh: torch.Tensor,
        sin_BSDh: torch.Tensor,
        mask_B1SS: torch.Tensor | None,
        attention: AttentionOptions | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        half = self.attention_half if self.execution.attention_half is None else self.execution.attention_half
        x_BSD, h_BSD, routing = half(x_BSD, cos_BSDh, sin_BSDh, mask_B1SS, attention)
        out = self.mlp(h_BSD) if routing is None else self.mlp(h_BSD, routing)
        if isinstance(out, tuple):  # an MoE block: (y, router logits)
            y_BSD, logits_TE = out
            return x_BSD + y_BSD, (logits_TE, routing[2])
        return x_BSD + out, None


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and the final norm (``model.*`` in checkpoints); a family says what its layers are:
    ``attention_class(config)``, then ``moe_block_class(config)`` where ``is_moe_layer(config, i)``, else a dense
    SwiGLU MLP of ``intermediate_size`` (:meth:`build_layer`).

    ``document_attention`` says how packed rows (``document_ids``) are masked: ``"auto"`` (default) uses a
    flex_attention ``BlockMask`` on CUDA (masked blocks skipped) and a dense SDPA mask elsewhere; ``"flex"`` and
    ``"dense"`` force one (the dense mask is the reference; it costs ``B·S²`` booleans per forward).
    flex_attention runs its fused kernel only compiled (eagerly it is a dense reference), so ``"auto"`` picks it
    only where the attention is compiled (``attention.compiled``, which ``parallelize(compile=True)`` sets).
    ``attention`` (one :class:`AttentionOptions` value, replaced whole by ``parallelize`` and
    ``apply_activation_checkpointing``) says which kernels a plain causal attention (no padding mask, no documents)
    runs, ``"sdpa"`` (default; SDPA's choice, cuDNN's on Hopper) or ``"fa4"`` (FlashAttention 4's, the optional
    ``flash-attn-4`` package; refused with the reason where it cannot run), and whether a checkpointed layer keeps
    that attention's output (``_kept.AttentionKeep``). Every layer gets it, resolved for the
    forward's device, beside the mask, which says only which keys a query sees. ``sequence`` (a
    :class:`SequenceLayout`, replaced whole by :func:`apply_sequence_parallel`) says which shard of each row the
    forward's tokens are.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = TokenEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.build_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.document_attention = "auto"
        self.attention = AttentionOptions()
        self.sequence = SequenceLayout()

    attention_class: type[nn.Module]
    """The family's attention, ``attention_class(config)``."""
    moe_block_class: type[nn.Module]
    """The family's MoE block, ``moe_block_class(config)``."""
    is_moe_layer: Callable[[PretrainedConfig, int], bool]
    """Whether layer ``i`` of a config has routed experts (a staticmethod of the family's subclass)."""
    norm_class: type[RMSNorm] = RMSNorm
    """The kind of the decoder's norms (:class:`RMSNorm`, or :class:`ZeroCenteredRMSNorm`)."""

    @classmethod
    def build_mixer(cls, config: PretrainedConfig, layer_idx: int) -> tuple[str, nn.Module]:
        """``(name, module)`` of layer ``layer_idx``'s sequence mixer: ``("self_attn", attention_class(config))``;
        a family with several layer kinds (e.g. ``config.layer_types``) overrides it."""
        return "self_attn", cls.attention_class(config)

    @classmethod
    def build_layer(cls, config: PretrainedConfig, layer_idx: int) -> DecoderLayer:
        """Decoder layer ``layer_idx``: the family's sequence mixer, then its MoE block or a dense MLP."""
        mlp = (
            cls.moe_block_class(config)
            if cls.is_moe_layer(config, layer_idx)
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )
        name, mixer = cls.build_mixer(config, layer_idx)
        return DecoderLayer(
            mixer,
            mlp,
            config.hidden_size,
            config.rms_norm_eps,
            layer_idx,
            mixer_name=name,
            norm_class=cls.norm_class,
        )

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None = None,
        position_ids_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(hidden_BSD after the final norm, each MoE layer's router logits, each one's selected expert ids)``."""
        x_BSD = self.embed_tokens(input_ids_BS)
        s = input_ids_BS.shape[1]
        if self.sequence.size > 1 and position_ids_BS is None:
            raise ValueError(
                "under sequence parallelism each rank holds a shard of the row: pass its whole-row position_ids "
                "(moeshard.sequence.shard_row gives them)"
            )
        if position_ids_BS is None:
            # As transformers: positions 0..S-1 even with left padding (the mask alone hides the pads).
            position_ids_BS = torch.arange(s, device=x_BSD.device)[None]
        elif position_ids_BS.dim() == 1:
            position_ids_BS = position_ids_BS[None]
        cos, sin = self.rotary_emb(position_ids_BS, x_BSD.dtype)
        # The mask is the whole row's: under sequence parallelism attention sees every token of it (on head shards),
        # and document_ids / attention_mask are the whole row's.
        kinds = {getattr(layer.mixer, "mask_kind", "attention") for layer in self.layers}
        masks = {}
        if "attention" in kinds:
            masks["attention"] = self._attention_mask(
                attention_mask_BS, document_ids_BS, s * self.sequence.size, x_BSD.device
            )
        if "segments" in kinds:  # mixers that carry state along the row restart it per document themselves
            row = s * self.sequence.size  # the whole row's ids under sequence parallelism
            if document_ids_BS is not None and document_ids_BS.shape[-1] != row:
                raise ValueError(
                    f"document_ids must be [batch, seq_len={row}] like the row's input_ids, got "
                    f"{tuple(document_ids_BS.shape)}"
                )
            masks["segments"] = RowSegments(document_ids_BS, attention_mask_BS, self.sequence)
        attention = self.attention.on(x_BSD.device)  # keep: only where the device has the kept kernels
        routed = []  # each MoE layer's (router logits, selected expert ids)
        for layer in self.layers:
            mask = masks[getattr(layer.mixer, "mask_kind", "attention")]
            x_BSD, pair = layer(x_BSD, cos, sin, mask, attention)
            routed += [] if pair is None else [pair]
        router_logits, router_ids = (tuple(t) for t in zip(*routed)) if routed else ((), ())
        return self.norm(x_BSD), router_logits, router_ids

    def _attention_mask(
        self,
        attention_mask_BS: torch.Tensor | None,
        document_ids_BS: torch.Tensor | None,
        s: int,
        device: torch.device,
    ) -> torch.Tensor | BlockMask | None:
        """One mask for every layer: None (causal), a dense boolean ``[B, 1, S, S]``, or a flex ``BlockMask``."""
        if document_ids_BS is None:
            mask = build_attention_mask(attention_mask_BS, s)
            if mask is not None:
                return mask
            if self.attention.kernel == "fa4" and (why := fa4_unavailable(device)) is not None:
                raise ValueError(
                    f"causal attention kernel 'fa4' cannot run here: {why}; set parallel.attention_kernel (the "
                    "model's attention.kernel) to 'sdpa'"
                )
            return None
        if document_ids_BS.shape[-1] != s:
            raise ValueError(
                f"document_ids must be [batch, seq_len={s}] like input_ids, got shape {tuple(document_ids_BS.shape)}"
            )
        kind = self.document_attention
        if kind not in ("auto", "flex", "dense"):
            raise ValueError(f"document_attention must be 'auto', 'flex' or 'dense', got {kind!r}")
        if kind == "flex" and not document_ids_BS.is_cuda and torch.is_grad_enabled():
            raise ValueError(
                "document_attention='flex' has no backward on CPU (flex_attention); use 'auto' or 'dense' there"
            )
        if kind == "flex" or (kind == "auto" and document_ids_BS.is_cuda and self.attention.compiled):
            if attention_mask_BS is not None:
                # Padding is a document of its own in packed rows (the data gives it id -1): no second mask.
                document_ids_BS = document_ids_BS.masked_fill(attention_mask_BS == 0, -1)
            return document_block_mask(document_ids_BS)
        return document_causal_mask(document_ids_BS, attention_mask_BS)


class MoECausalLM(nn.Module):
    """An MoE causal LM with transformers' FQNs, numerics and ``from_pretrained``/``save_pretrained`` face.

    A family subclass names ``base_model_class`` (its :class:`DecoderModel`) and ``hf_format`` (its checkpoints,
    whose ``check_config`` the config passes and whose ``num_experts`` counts the routed experts).

    Args:
        config: the family's transformers config; checked by ``hf_format.check_config``.
    """

    base_model_class: type[DecoderModel]
    """The decoder stack (``model.*``)."""
    hf_format: HFFormat
    """Its HF checkpoints (read by ``load_hf_weights`` and ``save_hf_checkpoint``)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.hf_format.check_config(config)
        self.config = config
        self.model = self.base_model_class(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (global)."""
        return self.hf_format.num_experts(self.config)

    @property
    def router_aux_loss_coef(self) -> float:
        """What ``forward`` adds the load-balancing loss with to ``loss``: ``config.router_aux_loss_coef`` (0 where
        the config has none, as transformers' DeepSeek-V3)."""
        return float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        return_logits: bool = True,
        shift_labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits and, with ``labels``, the loss (transformers semantics).

        Args:
            input_ids: ``[B, S]`` token ids.
            labels: ``[B, S]``, shifted inside (position t predicts ``labels[t + 1]``); ``-100`` is ignored.
            attention_mask: ``[B, S]``, 1 for tokens and 0 for padding; also excludes padding from the aux loss.
            position_ids: ``[B, S]`` or ``[S]``; default ``0..S-1``. Packed rows restart them in every document.
            document_ids: ``[B, S]``, packed rows: token ``t`` attends to ``j <= t`` only where the ids are equal
                (padding gets an id of its own, e.g. -1). With ``position_ids`` restarting per document, each
                document computes what it computes alone (``moeshard.data`` produces both).
            num_items_in_batch: when given, the LM loss is the sum over label tokens divided by it (for
                gradient accumulation / data parallel), else the mean over this call's label tokens.
            output_router_logits: compute ``aux_loss`` (and add ``router_aux_loss_coef * aux_loss`` to ``loss``,
                not to ``lm_loss``); default ``config.output_router_logits``.
            return_logits: with ``labels``, False computes the loss in chunks through the head without ever
                holding the ``[B, S, V]`` logits (training); ``logits`` is then None.
            shift_labels: instead of ``labels``, targets already shifted (position t predicts ``shift_labels[t]``):
                what a shard of a row needs under sequence parallelism, whose last token predicts the next
                shard's first (``moeshard.sequence.shard_row``'s ``targets``). Under sequence parallelism
                (:func:`apply_sequence_parallel`) ``input_ids`` is this rank's shard, ``position_ids`` its slice of
                the whole row's, and ``document_ids`` / ``attention_mask`` the whole row's.
        """
        if labels is not None and shift_labels is not None:
            raise ValueError("pass labels (shifted inside) or shift_labels (already shifted), not both")
        if self.model.sequence.size > 1 and labels is not None:
            raise ValueError(
                "under sequence parallelism a shard cannot shift its own labels (its last target is on the next "
                "rank): pass shift_labels, the targets moeshard.sequence.shard_row shifted over the whole row"
            )
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        hidden_BSD, router_logits, router_ids = self.model(input_ids, attention_mask, position_ids, document_ids)
        loss = logits_BSV = None
        if labels is not None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        if shift_labels is not None and not return_logits:
            loss = self.lm_head(hidden_BSD, targets_BS=shift_labels, num_items_in_batch=num_items_in_batch)
        else:
            logits_BSV = self.lm_head(hidden_BSD)
            if shift_labels is not None:
                loss = causal_lm_loss(logits_BSV, shift_labels, num_items_in_batch, shifted=True)
        aux_loss, lm_loss = None, loss
        if output_router_logits:
            if router_logits:
                if attention_mask is not None and self.model.sequence.size > 1:
                    # the router logits are this shard's tokens; the padding mask is the whole row's
                    attention_mask = self.model.sequence.local(attention_mask, input_ids.shape[1])
                aux_loss = load_balancing_loss(
                    router_logits, self.num_experts, self.config.num_experts_per_tok, attention_mask
                )
            else:  # no MoE layer at all
                aux_loss = torch.zeros((), device=hidden_BSD.device)
            if loss is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return CausalLMOutput(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits_BSV,
            router_logits=router_logits if output_router_logits else None,
            lm_loss=lm_loss,
            router_ids=router_ids if output_router_logits else None,
        )

    # ---- construction helpers --------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter as transformers does: normal(0, initializer_range) for linear, embedding,
        router and expert weights (linear biases zero, the padding row of the embedding zero), ones for norms.

        Works on a materialised model (after ``to_empty``), before or after EP/FSDP (DTensor parameters are
        initialised through the DTensor random ops). ``generator`` applies to plain parameters; DTensor parameters
        draw from DTensor's own generator, which ``torch.manual_seed`` seeds: for reproducible sharded weights call
        ``torch.manual_seed(s)`` with the same ``s`` on every rank first (as ``moeshard-train`` does).
        """
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    _zero_row(module.weight, module.padding_idx)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif hasattr(module, "init_weights_"):  # routers, experts: their own rule
                module.init_weights_(std, generator)

    def enable_router_bias(self) -> None:
        """Give every router a selection bias (zeros) for aux-loss-free balancing (see ``update_router_bias``).

        Call it after loading HF weights (their format has no such tensor) and before a distributed checkpoint is
        loaded or saved (theirs has). Each rank holds the whole ``[E]`` bias of each layer."""
        for router in routers(self):
            router.enable_bias()

    @staticmethod
    def get_parallel_plan() -> ParallelPlan:
        """Experts sharded on the expert dim for EP; embeddings, each decoder layer and the head as FSDP units.

        Layers without experts (dense layers) simply do not match the expert patterns; shared experts are part of
        their decoder layer's unit.
        """
        return ParallelPlan(
            ep_plan={
                "model.layers.*.mlp.experts.gate_up_proj": Shard(0),
                "model.layers.*.mlp.experts.down_proj": Shard(0),
            },
            fsdp_units=("model.embed_tokens", "model.layers.*", "lm_head"),
        )

    # ---- HF checkpoints --------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        expert_range: tuple[int, int] | None = None,
    ) -> MoECausalLM:
        """Build the model from a local HF directory (``config.json`` + safetensors) and load every weight.

        The model is built on ``meta``, materialised on ``device`` (default CPU) in ``dtype`` (default: the
        current default dtype, float32 unless changed) and filled by :func:`load_hf_weights`; float checkpoint
        tensors are cast to ``dtype``. With ``expert_range=(start, end)`` the expert tensors hold only global
        experts ``[start, end)`` and only those are read (for tools and converters; such a model runs forward
        only once EP provides the other experts).

        Raises:
            FileNotFoundError / ValueError: see :func:`load_hf_weights`.
        """
        from moeshard.models.common._hf_load import load_hf_config, load_hf_weights

        config = load_hf_config(path, cls.hf_format)
        with torch.device("meta"):
            model = cls(config)
        if expert_range is not None:
            model._slice_experts(expert_range)
        if dtype is not None:
            model.to(dtype)  # on meta: free, so memory is allocated once, in the final dtype
        model.to_empty(device=device or "cpu")
        load_hf_weights(model, path, expert_range=expert_range)
        return model

    def save_pretrained(
        self,
        path: str | os.PathLike,
        *,
        max_shard_size: int | str = "5GB",
        expert_layout: str = "per_expert",
    ) -> None:
        """Write ``config.json`` and safetensors shards (+ index when sharded) that transformers loads.

        ``expert_layout="per_expert"`` (default) writes the Hub's one-tensor-per-expert keys; ``"fused"`` writes
        ``gate_up_proj``/``down_proj`` as they are. The directory is replaced atomically (see
        :func:`save_hf_checkpoint`). Needs plain, complete parameters: gather a sharded model first.
        """
        from moeshard.models.common._hf_save import save_hf_checkpoint

        save_hf_checkpoint(self, path, max_shard_size=max_shard_size, expert_layout=expert_layout)

    def _slice_experts(self, expert_range: tuple[int, int]) -> None:
        start, end = expert_range
        if not 0 <= start < end <= self.num_experts:
            raise ValueError(
                f"expert_range={expert_range} must satisfy 0 <= start < end <= num_experts={self.num_experts}"
            )
        for module in self.modules():
            if isinstance(module, Experts):
                for name in ("gate_up_proj", "down_proj"):
                    old = getattr(module, name)
                    setattr(module, name, nn.Parameter(old.detach()[start:end].clone(), old.requires_grad))


def _zero_row(weight: torch.Tensor, row: int) -> None:
    """Zero row ``row`` of a plain or DTensor (local shard only: no communication) weight."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        from moeshard.models.common._hf_load import local_region

        offset, local = local_region(weight)
        if offset[0] <= row < offset[0] + local.shape[0]:
            local[row - offset[0]].zero_()
    else:
        weight[row].zero_()
