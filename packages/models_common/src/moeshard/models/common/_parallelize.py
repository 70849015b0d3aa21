"""Parallelising any family's model for training: one function, one fixed order, options passed in.

    meshes = build_meshes(ep_size=2)                       # under torchrun (or fake_process_group to plan)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(get_preset_config("deepseek-v3-16b"))     # or MoECausalLM(...)
    par = parallelize(model, meshes, ParallelOptions(compile=True, ep=EPOptions(kernels="triton")))
    model.to_empty(device="cuda")
    load_hf_weights(model, "/ckpt/Moonlight-16B-A3B", ep_info=par.ep_info)  # or torch.manual_seed(s); model.init_weights()

Needs the ``parallel`` extra (moeshard-meshes, moeshard-fsdp-moe, moeshard-prefetch), imported only when
:func:`parallelize` runs: the model itself needs none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch.utils.checkpoint import checkpoint

from moeshard.ep import EPInfo, EPOptions, ExpertDispatch, recompute_contexts
from moeshard.models.common._causal_lm import MoECausalLM
from moeshard.models.common._kept import CAUSAL_KERNELS, AttentionKeep
from moeshard.models.common._moe import TopKRouter

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.fsdp_moe import FSDPUnits
    from moeshard.meshes import ParallelMeshes
    from moeshard.prefetch import PrefetchSchedule

__all__ = ["ParallelOptions", "Parallelized", "apply_activation_checkpointing", "parallelize"]

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

    The fields are the vocabulary of every front end (the training job's ``parallel:`` section is generated from
    them: names, defaults, the ``Literal`` choices and the meanings below), so each is described here once.

    Attributes:
        ep: the expert-parallel options (dispatch strategy, kernel tier, expert GEMM, SM carve-out) given to
            ``moeshard.ep.apply_ep``.
        compile: ``torch.compile`` each decoder layer's ``attention_half`` (norms, projections, RoPE, attention,
            residual and the MoE block's router: one graph, shared by all layers; flex_attention for packed rows
            on CUDA runs inside it), the final norm, the
            LM head's loss chunk (rows dynamic; with the ``"triton"`` kernel tier of ``ep`` on CUDA a Triton kernel
            instead, two passes over the logits where the compiled chunk makes three) and the cast-and-scale of the
            gradients of experts kept out of FSDP.
            False compiles nothing (packed rows then use the dense document mask). Every compile in the packages
            is decided here; a compile that fails raises.
        activation_checkpointing: what backward recomputes instead of keeping from forward: ``"none"``;
            ``"full"`` (each decoder layer's forward is checkpointed and recomputed in backward, FQNs unchanged,
            except what only its output needs: the routed experts' down projections, the outputs' way back and
            the combine; the exchange out runs again, its sizes replayed: no extra host sync); ``"selective"``
            (inside the routed experts only, as ``selective_recompute`` says: no exchange runs again, results
            bit-identical).
            ``True`` / ``False`` are read as ``"full"`` / ``"none"``.
        keep_attention: with ``"full"``, each layer also keeps from the forward its attention's output and
            log-sum-exp, its output projection's output and its router's top-k (``H·Dv + D`` compute-dtype and
            ``H`` float32 elements per token, where the layer's input is ``D``: 3x the input at Qwen3-30B-A3B's
            shapes), so the recompute runs neither the attention kernel, nor that GEMM, nor the selection (one
            H200, 8 layers of 30B-A3B, micro-batch 4: +10.0% over no checkpointing, +15% without). The attention
            is kept for plain causal rows on CUDA (cuDNN's or FlashAttention 4's kernels) and CPU where the query
            and value head sizes are equal (Qwen3-MoE; not DeepSeek-V3's MLA, nor packed documents or padding
            masks: those recompute it); the projection wherever the rows are plain causal; the top-k for softmax
            top-k routers. Ignored otherwise.
        attention_kernel: the kernels of a plain causal attention (rows without padding or packed documents):
            ``"sdpa"`` (what ``scaled_dot_product_attention`` picks: cuDNN's on Hopper) or ``"fa4"``
            (FlashAttention 4's, from the optional ``flash-attn-4`` package, ``pip install
            'moeshard-models-common[fa4]'``: Hopper and Blackwell GPUs, one head size for q, k and v up to 256;
            one H200, Qwen3-30B-A3B's attention: forward + backward 3.67 against cuDNN's 4.20 ms per layer at 4 x
            4,096 tokens). The model refuses ``"fa4"`` with the reason before its first layer where it cannot
            run; where a layer's shapes do not fit it (DeepSeek-V3's MLA) that layer runs SDPA. Under
            ``keep_attention`` its output is kept as SDPA's is.
        selective_recompute: with ``"selective"``, the expert intermediates recomputed (``EPOptions.recompute``):
            ``"activation"`` (default: the gated activation, from the saved gate/up output, inside the activation's
            backward kernel: ``F`` elements per routed copy for an extra write of them, +0.3% per step on one
            H200) or ``"mlp"`` (the gate/up grouped GEMM too, from the saved expert input: ``3F`` elements per
            routed copy for one more GEMM per layer in backward, +5.9%).
        param_dtype: the compute dtype: ``auto`` (bfloat16 on CUDA, float32 elsewhere), ``float32`` or
            ``bfloat16``; master weights and gradient reduction stay float32 (the experts': ``expert_reduce_dtype``).
        reshard_after_forward: free each unit's gathered parameters after its forward (gather again in backward).
            None (the default): True where the FSDP mesh has more than one rank; False on one rank, where nothing is
            sharded (keeping the gathered compute-dtype copy costs only its bytes, 0.3 GiB at 8 layers of
            Qwen3-30B-A3B, and saves a gather's copies and hooks per unit and micro-batch).
        expert_reduce_dtype: the dtype of the expert units' gradient reduce-scatter over ``ep_fsdp``: ``float32``
            or ``bfloat16`` (half the bytes, summed in bfloat16; the gradients still land in float32). Only where
            experts are FSDP units (ep_fsdp > 1).
        expert_reshard_after_forward: for the expert units (ep_fsdp > 1): None follows ``reshard_after_forward``;
            False keeps their gathered parameters from forward to backward (one all-gather per micro-batch instead
            of two, for the gathered experts' memory through the forward).
        prefetch_depth: units each stage prefetches ahead (forward) and behind (backward); 0 keeps FSDP's default
            order.
        prefetch_at_host_sync: with EP > 1 and ``prefetch_depth`` > 0, issue the next layer's all-gathers at each
            MoE layer's device->host sync instead of in the layer's pre-forward (the same prefetches, issued while
            the host would otherwise wait); ignored otherwise.
    """

    ep: EPOptions = field(default_factory=EPOptions)
    compile: bool = False
    activation_checkpointing: Literal[CHECKPOINTING] | bool = "none"
    keep_attention: bool = True
    attention_kernel: Literal[CAUSAL_KERNELS] = "sdpa"
    selective_recompute: Literal[SELECTIVE] = "activation"
    param_dtype: Literal[PARAM_DTYPES] = "auto"
    reshard_after_forward: bool | None = None
    expert_reduce_dtype: Literal[REDUCE_DTYPES] = "float32"
    expert_reshard_after_forward: bool | None = None
    prefetch_depth: int = 1
    prefetch_at_host_sync: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.ep, EPOptions):
            raise ValueError(f"ParallelOptions.ep={self.ep!r} is not allowed: a moeshard.ep.EPOptions")
        if isinstance(self.activation_checkpointing, bool):  # the bool of 0.3
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
                f"ParallelOptions.ep has recompute={self.ep.recompute!r}: set "
                f"activation_checkpointing='selective', selective_recompute={self.ep.recompute!r} instead (the "
                "checkpointing policy is chosen in one place)"
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
        ]


_CHECKPOINTING_LINES = {
    "none": "off",
    "full": "full (each decoder layer recomputed in backward)",
    "selective": "selective (the routed experts recompute: {0.selective_recompute})",
}


@dataclass
class Parallelized:
    """What :func:`parallelize` did.

    Attributes:
        units: the FSDP units in forward order (``moeshard.fsdp_moe.shard_model``).
        schedule: the applied prefetch schedule, or None with ``prefetch_depth`` 0.
        ep_info: the EP metadata ``moeshard.ep.apply_ep`` recorded (experts held, global shapes).
        options: the options it was given.
        keeps_gathered: every FSDP unit keeps its gathered parameters from forward to backward (neither
            ``reshard_after_forward`` nor the experts' resolved to True): a loop that accumulates gradients over
            micro-batches may then also keep them gathered between the micro-batches
            (``set_reshard_after_backward(False)`` before all but the last backward) at no extra peak memory.
    """

    units: FSDPUnits
    schedule: PrefetchSchedule | None
    ep_info: EPInfo | None
    options: ParallelOptions
    keeps_gathered: bool = False


def parallelize(
    model: MoECausalLM, meshes: ParallelMeshes, options: ParallelOptions = ParallelOptions()
) -> Parallelized:
    """Apply expert parallelism, activation checkpointing, compilation, FSDP2 and prefetching, in that order.

    Why this order:

    1. **EP** (``moeshard.ep.apply_ep``) first: it slices the expert tensors to this rank's experts and installs
       each MoE layer's dispatcher, and it must see the model's own FQNs and plain (not yet DTensor) parameters.
       Everything after works on the EP-local experts (FSDP shards those again, on dim 1).
    2. **Activation checkpointing**: ``"full"`` checkpoints each decoder layer's forward from outside
       (:func:`apply_activation_checkpointing`: no wrapper module, FQNs kept); ``"selective"`` is an EP option of
       step 1 (the experts' intermediates recomputed).
    3. **Compile**: ``layer.attention_half = torch.compile(layer.attention_half)`` on each decoder layer (an
       instance attribute: FQNs and the state dict unchanged), the final norm's ``forward`` likewise, and
       ``moeshard.ep.compile_rows_dynamic`` on the
       head's loss chunk (with ``ep.kernels="triton"``, the head's Triton loss-chunk kernel). Nothing compiles until the first forward. The compiled region lies inside the layer's
       forward, so FSDP's hooks (after step 4) run outside it and it sees plain gathered parameters; under
       checkpointing the recomputation runs the compiled graph again. The routed experts stay eager: they sync
       with the host (split sizes), where a graph would break anyway.
    4. **FSDP2** (``moeshard.fsdp_moe.shard_model``), bottom-up: experts on ``meshes.ep_fsdp`` (dim 1), then
       each unit and the root on ``meshes.fsdp``, with the mixed-precision policy of ``options.param_dtype``
       (the expert units' reduce-scatter in ``options.expert_reduce_dtype``). It is given the EP metadata step 1
       returned (``ep_info``: it never applies EP itself).
    5. **Prefetch** last, over the units of step 4 (``moeshard.prefetch.build_schedule`` / ``apply_schedule``;
       with EP > 1 and ``prefetch_at_host_sync`` the forward prefetches are issued at each MoE layer's host sync,
       through ``ep_info.add_host_sync_hook``, the hooks of the dispatchers step 1 installed).

    It does not materialise or load weights: a model built on ``meta`` stays there (``plan`` builds any world size
    with the fake backend). Then ``model.to_empty(device=...)`` and ``load_hf_weights(model, path,
    ep_info=result.ep_info)``, or ``torch.manual_seed(s); model.init_weights()``.

    Args:
        model: a :class:`MoECausalLM` without EP or FSDP applied, on ``meta`` or materialised.
        meshes: ``moeshard.meshes.build_meshes(ep_size=...)`` of this job.
        options: see :class:`ParallelOptions`.

    Returns:
        The FSDP units, the prefetch schedule, the EP metadata and the options (:class:`Parallelized`).

    Raises:
        TypeError: ``model`` is not a :class:`MoECausalLM` or ``options`` not a :class:`ParallelOptions`.
        ValueError: from ``apply_ep`` / ``shard_model`` (EP or FSDP already applied, an EP size that does not
            divide the experts, meshes of another world, ...).
    """
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import shard_model
    from moeshard.prefetch import apply_schedule, build_schedule, prefetch_forward_at_host_sync

    if not isinstance(model, MoECausalLM):
        raise TypeError(f"parallelize takes a model family's causal LM (an MoECausalLM), got {type(model).__name__}")
    if not isinstance(options, ParallelOptions):
        raise TypeError(f"options must be a ParallelOptions, got {type(options).__name__}")

    ep_mesh = meshes.ep if meshes.ep_size > 1 else None
    ep_info = apply_ep(model, model.get_parallel_plan(), ep_mesh, options.ep_options())
    model.model.causal_attention = options.attention_kernel
    if options.activation_checkpointing == "full":
        apply_activation_checkpointing(model, keep_attention=options.keep_attention)
    if options.compile:
        _compile(model, options.ep.kernels)
    reshard, expert_reshard = options.resharding(meshes.world_size)
    units = shard_model(
        model,
        meshes,
        ep_info=ep_info,
        compile=options.compile,
        mp_policy=_mp_policy(options.param_dtype, meshes.device_type),
        reshard_after_forward=reshard,
        expert_reduce_dtype=getattr(torch, options.expert_reduce_dtype),
        expert_reshard_after_forward=expert_reshard,
    )
    _hand_over_float32_grads(model)
    schedule = None
    if options.prefetch_depth > 0:
        schedule = build_schedule(units.stages, depth=options.prefetch_depth)
        apply_schedule(schedule)
        if options.prefetch_at_host_sync and meshes.ep_size > 1:
            prefetch_forward_at_host_sync(schedule, ep_info.add_host_sync_hook)
    keeps_gathered = not reshard and (meshes.ep_fsdp_size == 1 or not expert_reshard)
    return Parallelized(units=units, schedule=schedule, ep_info=ep_info, options=options, keeps_gathered=keeps_gathered)


def _hand_over_float32_grads(model: MoECausalLM) -> None:
    """The embedding's and the head's weight gradients go to their FSDP units in float32 (the units'
    ``reduced_grad_target``; inert where FSDP2 reduces in the compute dtype): the head's float32 sum is never
    rounded to bfloat16, the embedding adds its rows instead of a dense ``[V, D]`` gradient, and FSDP2 casts or adds
    neither (see ``moeshard.fsdp_moe.reduced_grad_target``). The other units' gradients, which FSDP2 accumulates
    in float32 between micro-batches that do not reduce, are added in one vectorised pass per unit
    (``moeshard.fsdp_moe.grouped_grad_accumulation``)."""
    from torch.distributed.fsdp import FSDPModule

    from moeshard.fsdp_moe import grouped_grad_accumulation, reduced_grad_target

    for module in (model.model.embed_tokens, model.lm_head):
        if isinstance(module, FSDPModule) and hasattr(module, "grad_target"):
            module.grad_target = reduced_grad_target(module)
    grouped_grad_accumulation(model)


def _compile(model: MoECausalLM, kernels: str) -> None:
    """Step 3 of :func:`parallelize`: each layer's attention half, the final norm and the head's loss chunk,
    compiled; with the ``"triton"`` kernel tier on a machine with CUDA, the loss chunk's Triton kernel instead and the
    routers' (``TopKRouter``) top-k by its Triton kernel (as ``moeshard.ep``'s tier: without CUDA, the compiled
    function and ``torch.topk``, and triton is not imported).

    Raises:
        ImportError: the ``"triton"`` tier on a machine with CUDA where triton cannot be imported."""
    from moeshard.ep import compile_rows_dynamic

    model.model.compiled_attention = True  # packed rows: flex_attention's fused kernel, compiled inside
    for layer in model.model.layers:
        # At the call site, from outside (the bound method, compiled): every layer shares one graph.
        layer.attention_half = torch.compile(layer.attention_half)
    # The final norm, which no layer's graph holds: eager, its float32 statistics are ~8 kernels over the
    # [tokens, D] rows forward and ~15 backward (~2 ms per step of 16k tokens of the 30B-A3B geometry on one H200),
    # compiled one pass each way.
    model.model.norm.forward = torch.compile(model.model.norm.forward)
    # The row count varies (the last chunk), the vocabulary width never does.
    if kernels == "triton" and torch.cuda.is_available():
        try:
            from moeshard.models.common._lm_loss_triton import ce_chunk_triton_
            from moeshard.models.common._topk_triton import topk_ids_op
        except ImportError as e:
            raise ImportError(
                "the 'triton' kernel tier (EPOptions(kernels='triton')) computes the LM head's loss chunk and the "
                "routers' top-k with triton kernels, but triton cannot be imported: install it (pip install triton) "
                "or use kernels='compiled'"
            ) from e
        model.lm_head.chunk_loss = ce_chunk_triton_  # the gradient over the chunk's logits: one [C, V] buffer
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, TopKRouter):  # the selection by the kernel (an opaque op in the compiled half)
                    module.topk_kernel = topk_ids_op
    else:
        model.lm_head.chunk_loss = compile_rows_dynamic(model.lm_head.chunk_loss)


def apply_activation_checkpointing(model: MoECausalLM, *, keep_attention: bool = True) -> None:
    """Recompute each decoder layer in backward: its ``forward`` becomes (an instance attribute, so FQNs, the state
    dict and FSDP's hooks are untouched) a non-reentrant ``torch.utils.checkpoint`` of itself.

    Applied from outside the model (:func:`parallelize` calls it with ``activation_checkpointing="full"``, after EP
    and before compile and FSDP): FSDP's hooks run outside the checkpointed region, as with torch's checkpoint
    wrapper, and the recompute in backward replays the EP layers' received counts and exchange sizes recorded by
    the forward (``moeshard.ep.recompute_contexts`` of the layer's dispatchers): no extra host sync or counts
    exchange. It recomputes what backward keeps and leaves out what only the layer's output needs
    (``discard_outputs``: the experts' down projections, the outputs' way back to their tokens' ranks and the
    combine). Without grad (eval) the forward runs plainly.

    ``keep_attention``: each layer keeps its attention's output and log-sum-exp, its output projection's output and
    its router's top-k from the forward, and the recompute replays them instead of running the attention kernel,
    the projection's GEMM and the selection (``moeshard.models.common.AttentionKeep``; plain causal rows, see
    ``ParallelOptions.keep_attention``; the top-k of :class:`TopKRouter`). The EP layers replay their route (the
    copies' order) too, always. The same bits.

    Raises:
        ValueError: already applied.
    """
    for layer in model.model.layers:
        if "forward" in layer.__dict__:
            raise ValueError("activation checkpointing is already applied to this model; apply it once")
    for layer in model.model.layers:
        layer.forward = _checkpointed(layer.forward, layer, keep_attention)
        for module in layer.modules():
            if isinstance(module, TopKRouter):
                module.keep_selection = keep_attention
    model.model.keep_attention = keep_attention


def _checkpointed(forward, layer: torch.nn.Module, keep_attention: bool):
    def contexts():
        # Looked up at each call: the dispatchers apply_ep installed, whenever it ran. The routed experts' output
        # only flows into additions in a decoder layer (shared experts, the residual), which save nothing for
        # backward: the recompute leaves out their down projections, the way back and the combine.
        dispatchers = [m.dispatch for m in layer.modules() if isinstance(getattr(m, "dispatch", None), ExpertDispatch)]
        record, replay = recompute_contexts(dispatchers, discard_outputs=True)
        if not keep_attention:
            return record, replay
        keep = AttentionKeep()  # per call: what it keeps lives as long as this checkpoint's graph
        return _Both(record, keep.recording()), _Both(replay, keep.replaying())

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    return run


class _Both:
    """Two context managers entered as one (``checkpoint``'s ``context_fn`` returns one per pass)."""

    def __init__(self, first, second) -> None:
        self._contexts, self._stack = (first, second), contextlib.ExitStack()

    def __enter__(self):
        for c in self._contexts:
            self._stack.enter_context(c)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def _mp_policy(param_dtype: str, device_type: str) -> MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.fsdp_moe import default_mp_policy

    if param_dtype == "auto":
        return default_mp_policy(device_type)
    # An explicit dtype is the compute dtype; master weights and gradient reduction stay float32; inputs are not
    # cast (the loss's float32 divisor would be rounded, see default_mp_policy).
    return MixedPrecisionPolicy(
        param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32, cast_forward_inputs=False
    )
