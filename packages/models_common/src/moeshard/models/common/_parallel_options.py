"""What :func:`moeshard.models.common.parallelize` takes: :class:`ParallelOptions`, one frozen value checked when it is
made, and the values each of its fields may take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from moeshard.ep import EPOptions
from moeshard.models.common._kept import CAUSAL_KERNELS

__all__ = ["ParallelOptions"]

PARAM_DTYPES = ("auto", "float32", "bfloat16")
"""Values of :attr:`ParallelOptions.param_dtype`: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
CHECKPOINTING = ("none", "full", "selective")
"""Values of :attr:`ParallelOptions.activation_checkpointing` (``True``/``False`` mean ``full``/``none``)."""
SELECTIVE = ("activation", "mlp")
"""Values of :attr:`ParallelOptions.selective_recompute`."""
REDUCE_DTYPES = ("float32", "bfloat16")
"""Values of :attr:`ParallelOptions.expert_reduce_dtype`."""


@dataclass(frozen=True)
class ParallelOptions:
    """How :func:`parallelize` parallelises the model; each field is validated on construction (``ValueError``).

    The fields are the vocabulary of every front end (the training job's ``parallel:`` section is this class, with
    ``ep`` nested), so each is named, limited (its ``Literal`` type and :meth:`__post_init__`, whose ``ValueError``
    names it as ``ParallelOptions.<field>``) and explained (its ``help`` metadata, one line for front ends to print)
    in one place, its definition below.
    """

    ep: EPOptions = field(
        default_factory=EPOptions,
        metadata={
            "help": "the expert-parallel options (dispatch strategy, kernel tier, expert GEMM, SM carve-out) given to "
            '`moeshard.ep.apply_ep`; their `recompute` stays `"none"` here (`activation_checkpointing` '
            '`"selective"` with `selective_recompute` sets it).'
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "help": "`torch.compile` each decoder layer's `attention_half` (norms, projections, RoPE, attention, "
            "residual and the MoE block's router: one graph, shared by all layers; flex_attention for packed rows on "
            'CUDA runs inside it), the final norm, the LM head\'s loss chunk (rows dynamic; with the `"triton"` '
            "kernel tier of `ep` on CUDA a Triton kernel instead, two passes over the logits where the compiled chunk "
            "makes three) and the cast-and-scale of the gradients of experts kept out of FSDP. False compiles nothing "
            "(packed rows then use the dense document mask). Every compile in the packages is decided here; a compile "
            "that fails raises."
        },
    )
    activation_checkpointing: Literal[CHECKPOINTING] | bool = field(
        default="none",
        metadata={
            "help": 'what backward recomputes instead of keeping from forward: `"none"`; `"full"` (each '
            "decoder layer's forward is checkpointed and recomputed in backward, FQNs unchanged, except what only its "
            "output needs: the routed experts' down projections, the outputs' way back and the combine; the exchange "
            'out runs again, its sizes replayed: no extra host sync); `"selective"` (inside the routed experts '
            "only, as `selective_recompute` says: no exchange runs again, results bit-identical). `True` / `False` "
            'are read as `"full"` / `"none"`.'
        },
    )
    keep_attention: bool = field(
        default=True,
        metadata={
            "help": 'with `"full"`, each layer also keeps from the forward its attention\'s output and '
            "log-sum-exp, its output projection's output and its router's top-k (`H·Dv + D` compute-dtype and `H` "
            "float32 elements per token, where the layer's input is `D`: 3x the input at Qwen3-30B-A3B's shapes), so "
            "the recompute runs neither the attention kernel, nor that GEMM, nor the selection (the step's cost with "
            "and without: `docs/performance.md`). The attention is kept for plain "
            "causal rows on CUDA (cuDNN's or FlashAttention 4's kernels) and CPU where the query and value head sizes "
            "are equal (Qwen3-MoE; not DeepSeek-V3's MLA, nor packed documents or padding masks: those recompute "
            "it); the projection wherever the rows are plain causal; the top-k for softmax top-k routers. Ignored "
            "otherwise."
        },
    )
    attention_kernel: Literal[CAUSAL_KERNELS] = field(
        default="sdpa",
        metadata={
            "help": 'the kernels of a plain causal attention (rows without padding or packed documents): `"sdpa"` '
            "(what `scaled_dot_product_attention` picks: cuDNN's on Hopper) or `\"fa4\"` (FlashAttention 4's, from "
            "the optional `flash-attn-4` package, `pip install 'moeshard-models-common[fa4]'`: Hopper and Blackwell "
            "GPUs, one head size for q, k and v up to 256; its speed against cuDNN's: `docs/performance.md`). "
            'The model refuses `"fa4"` with the '
            "reason before its first layer where it cannot run; where a layer's shapes do not fit it (DeepSeek-V3's "
            "MLA) that layer runs SDPA. Under `keep_attention` its output is kept as SDPA's is."
        },
    )
    selective_recompute: Literal[SELECTIVE] = field(
        default="activation",
        metadata={
            "help": 'with `"selective"`, the expert intermediates recomputed (`EPOptions.recompute`): '
            '`"activation"` (default: the gated activation, from the saved gate/up output, inside the '
            "activation's backward kernel: `F` elements per routed copy for an extra write of them) or "
            '`"mlp"` (the gate/up grouped GEMM too, from the saved expert input: `3F` elements per routed copy for '
            "one more GEMM per layer in backward); what each costs a step: `docs/performance.md`."
        },
    )
    param_dtype: Literal[PARAM_DTYPES] = field(
        default="auto",
        metadata={
            "help": "the compute dtype: `auto` (bfloat16 on CUDA, float32 elsewhere), `float32` or `bfloat16`; "
            "master weights and gradient reduction stay float32 (the experts': `expert_reduce_dtype`)."
        },
    )
    reshard_after_forward: bool | None = field(
        default=None,
        metadata={
            "help": "free each unit's gathered parameters after its forward (gather again in backward). None (the "
            "default): True where the FSDP mesh has more than one rank; False on one rank, where nothing is sharded "
            "(keeping the gathered compute-dtype copy costs only its bytes, "
            "and saves a gather's copies and hooks per unit and micro-batch)."
        },
    )
    expert_reduce_dtype: Literal[REDUCE_DTYPES] = field(
        default="float32",
        metadata={
            "help": "the dtype of the expert units' gradient reduce-scatter over `ep_fsdp`: `float32` or `bfloat16` "
            "(half the bytes, summed in bfloat16; the gradients still land in float32). Only where experts are FSDP "
            "units (ep_fsdp > 1)."
        },
    )
    expert_reshard_after_forward: bool | None = field(
        default=None,
        metadata={
            "help": "for the expert units (ep_fsdp > 1): None follows `reshard_after_forward`; False keeps their "
            "gathered parameters from forward to backward (one all-gather per micro-batch instead of two, for the "
            "gathered experts' memory through the forward)."
        },
    )
    prefetch_depth: int = field(
        default=1,
        metadata={
            "help": "units each stage prefetches ahead (forward) and behind (backward); 0 keeps FSDP's default order."
        },
    )
    prefetch_at_host_sync: bool = field(
        default=True,
        metadata={
            "help": "with EP > 1 and `prefetch_depth` > 0, issue the next layer's all-gathers at each MoE layer's "
            "device->host sync instead of in the layer's pre-forward (the same prefetches, issued while the host "
            "would otherwise wait); ignored otherwise."
        },
    )

    sp_size: int = field(
        default=1,
        metadata={
            "help": "sequence-parallel (Ulysses) ranks sharing each row: consecutive ranks of a node, each holding "
            "seq_len/sp_size contiguous tokens; attention runs on num_heads/sp_size heads of the whole row between "
            "two all-to-alls (key/value heads replicated where fewer), everything else on the shard. Divides the "
            "ranks per node, the query heads and seq_len; the data-parallel degree is world/sp_size. 1: off."
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.ep, EPOptions):
            raise ValueError(f"ParallelOptions.ep={self.ep!r} is not allowed: a moeshard.ep.EPOptions")
        if isinstance(self.activation_checkpointing, bool):  # a YAML switch; configs saved by 0.4 may hold one
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"ParallelOptions.activation_checkpointing={self.activation_checkpointing!r} is not one of "
                f"{CHECKPOINTING}"
            )
        if self.selective_recompute not in SELECTIVE:
            raise ValueError(
                f"ParallelOptions.selective_recompute={self.selective_recompute!r} is not one of {SELECTIVE}"
            )
        if self.ep.recompute != "none":
            raise ValueError(
                f"ParallelOptions.ep.recompute={self.ep.recompute!r} is not allowed: set "
                f"ParallelOptions.activation_checkpointing='selective' and "
                f"ParallelOptions.selective_recompute={self.ep.recompute!r} instead (the checkpointing policy is "
                "chosen in one place)"
            )
        for name in ("compile", "keep_attention", "prefetch_at_host_sync"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"ParallelOptions.{name}={value!r} is not allowed: True or False")
        if self.attention_kernel not in CAUSAL_KERNELS:
            raise ValueError(
                f"ParallelOptions.attention_kernel={self.attention_kernel!r} is not one of {CAUSAL_KERNELS}"
            )
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"ParallelOptions.param_dtype={self.param_dtype!r} is not one of {PARAM_DTYPES}")
        if self.expert_reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"ParallelOptions.expert_reduce_dtype={self.expert_reduce_dtype!r} is not one of {REDUCE_DTYPES}"
            )
        for name in ("reshard_after_forward", "expert_reshard_after_forward"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                default = "one rank or more" if name == "reshard_after_forward" else "as reshard_after_forward"
                raise ValueError(f"ParallelOptions.{name}={value!r} is not allowed: None ({default}), True or False")
        sp = self.sp_size
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
            raise ValueError(f"ParallelOptions.sp_size={sp!r} is not allowed: an int >= 1 (1: no sequence parallelism)")
        if sp > 1 and self.compile:
            raise ValueError(
                f"ParallelOptions.sp_size={sp} with compile=True is not supported: the attention's all-to-alls "
                "would sit inside the compiled attention half; set compile to false or sp_size to 1"
            )
        depth = self.prefetch_depth
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(
                f"ParallelOptions.prefetch_depth={depth!r} is not allowed: an int >= 0 (0 = FSDP's default order)"
            )

    def resharding(self, world_size: int) -> tuple[bool, bool]:
        """``(reshard_after_forward, expert_reshard_after_forward)`` as booleans for a job of ``world_size`` ranks
        (None resolved: see the attributes)."""
        reshard = world_size > 1 if self.reshard_after_forward is None else self.reshard_after_forward
        experts = reshard if self.expert_reshard_after_forward is None else self.expert_reshard_after_forward
        return reshard, experts

    def ep_options(self) -> EPOptions:
        """The EP options :func:`parallelize` gives ``apply_ep``: ``ep`` with the experts' recompute of
        ``"selective"`` checkpointing."""
        if self.activation_checkpointing != "selective":
            return self.ep
        return dataclasses.replace(self.ep, recompute=self.selective_recompute)

    def describe(self) -> list[str]:
        """The options as lines for ``plan``, e.g. ``compile: attention half of each decoder layer, final norm, loss chunk``."""
        dtype = {"auto": "auto (bfloat16 on CUDA, float32 elsewhere)"}.get(self.param_dtype, self.param_dtype)
        if self.prefetch_depth == 0:
            prefetch = "off (FSDP's default order)"
        else:
            where = "at each MoE layer's host sync when EP > 1" if self.prefetch_at_host_sync else "in pre-forward"
            prefetch = f"depth {self.prefetch_depth}, forward prefetch issued {where}"
        experts = self.expert_reshard_after_forward
        experts = None if experts is None or experts == self.reshard_after_forward else experts
        reshard = self.reshard_after_forward
        reshard = "auto (True, False where the FSDP mesh has one rank)" if reshard is None else reshard
        return [
            f"ep: {self.ep_options().describe()}",
            "compile: "
            + (
                "attention half of each decoder layer, final norm, loss chunk"
                + (" (a triton kernel on CUDA)" if self.ep.kernels == "triton" else "")
                if self.compile
                else "off"
            ),
            "activation checkpointing: "
            + _CHECKPOINTING_LINES[self.activation_checkpointing].format(self)
            + (
                ", the attention's output, its projection and the top-k kept"
                if self.activation_checkpointing == "full" and self.keep_attention
                else ""
            ),
            "causal attention: "
            + (
                "FlashAttention 4 (flash-attn-4)"
                if self.attention_kernel == "fa4"
                else "SDPA's choice (cuDNN on Hopper)"
            ),
            f"param dtype: {dtype}; master weights and gradient reduction float32"
            + ("" if self.expert_reduce_dtype == "float32" else ", the experts' reduce-scatter bfloat16 (ep_fsdp > 1)"),
            f"reshard after forward: {reshard}" + ("" if experts is None else f", experts {experts} (ep_fsdp > 1)"),
            f"prefetch: {prefetch}",
        ] + (
            [
                f"sequence parallel: sp {self.sp_size} (each rank holds 1/{self.sp_size} of every row; attention "
                f"on 1/{self.sp_size} of the heads between two all-to-alls)"
            ]
            if self.sp_size > 1
            else []
        )


_CHECKPOINTING_LINES = {
    "none": "off",
    "full": "full (each decoder layer recomputed in backward)",
    "selective": "selective (the routed experts recompute: {0.selective_recompute})",
}
