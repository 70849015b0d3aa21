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

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from moeshard.ep import EPInfo, fqn_matches
from moeshard.models.common._causal_lm import MoECausalLM
from moeshard.models.common._checkpointing import apply_activation_checkpointing
from moeshard.models.common._head import LMHead
from moeshard.models.common._layers import TokenEmbedding
from moeshard.models.common._moe import TopKRouter
from moeshard.models.common._parallel_options import ParallelOptions
from moeshard.models.common._sequence_parallel import apply_sequence_parallel

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.fsdp_moe import FSDPUnits
    from moeshard.meshes import ParallelMeshes
    from moeshard.prefetch import PrefetchSchedule

__all__ = ["Parallelized", "parallelize"]


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
    """Apply expert parallelism, sequence parallelism, activation checkpointing, compilation, FSDP2 and
    prefetching, in that order.

    Why this order:

    1. **EP** (``moeshard.ep.apply_ep``) first: it slices the expert tensors to this rank's experts and installs
       each MoE layer's dispatcher, and it must see the model's own FQNs and plain (not yet DTensor) parameters.
       Everything after works on the EP-local experts (FSDP shards those again, on dim 1).
       With ``sp_size`` > 1, :func:`apply_sequence_parallel` over ``meshes.sp`` then runs each attention on head
       shards of the whole row (it changes no parameter: checkpoints are the same at any sp).
    2. **Activation checkpointing**: ``"full"`` checkpoints each decoder layer's forward from outside
       (:func:`apply_activation_checkpointing`: no wrapper module, FQNs kept); ``"selective"`` is an EP option of
       step 1 (the experts' intermediates recomputed).
    3. **Compile**: ``torch.compile(layer.attention_half)`` on each decoder layer (in the layer's ``execution``,
       which its forward reads: FQNs and the state dict unchanged), the final norm's call (``nn.Module.compile``),
       and ``moeshard.ep.compile_rows_dynamic`` on the head's loss chunk (its ``options.chunk_loss``; with
       ``ep.kernels="triton"``, the head's Triton loss-chunk kernel). Nothing compiles until the first forward.
       The compiled region lies inside the layer's forward, so FSDP's hooks (after step 4) run outside it and it sees plain gathered parameters; under
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

    if options.sp_size != meshes.sp_size:
        raise ValueError(
            f"ParallelOptions.sp_size={options.sp_size} but the meshes were built with sp_size={meshes.sp_size}; "
            f"pass the same sp_size to build_meshes and ParallelOptions"
        )
    ep_mesh = meshes.ep if meshes.ep_size > 1 else None
    ep_info = apply_ep(model, _with_adapters(model.get_parallel_plan(), model), ep_mesh, options.ep_options())
    if options.sp_size > 1:
        apply_sequence_parallel(model, meshes.sp)
    # The attention's kernel, and (step 3) whether it runs compiled: one value the model passes to every layer.
    model.model.attention = dataclasses.replace(
        model.model.attention, kernel=options.attention_kernel, compiled=options.compile
    )
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
    ``reduced_grad_target``, given in their ``options``; inert where FSDP2 reduces in the compute dtype): the head's
    float32 sum is never rounded to bfloat16, the embedding adds its rows instead of a dense ``[V, D]`` gradient, and
    FSDP2 casts or adds neither (see ``moeshard.fsdp_moe.reduced_grad_target``). The other units' gradients, which
    FSDP2 accumulates in float32 between micro-batches that do not reduce, are added in one vectorised pass per unit
    (``moeshard.fsdp_moe.grouped_grad_accumulation``)."""
    from torch.distributed.fsdp import FSDPModule

    from moeshard.fsdp_moe import grouped_grad_accumulation, reduced_grad_target

    for module in (model.model.embed_tokens, model.lm_head):
        if isinstance(module, FSDPModule) and isinstance(module, (TokenEmbedding, LMHead)):
            module.options = dataclasses.replace(module.options, grad_target=reduced_grad_target(module))
    grouped_grad_accumulation(model)


def _compile(model: MoECausalLM, kernels: str) -> None:
    """Step 3 of :func:`parallelize`: each layer's attention half, the final norm and the head's loss chunk,
    compiled; with the ``"triton"`` kernel tier on a machine with CUDA, the loss chunk's Triton kernel instead and the
    routers' (``TopKRouter``) top-k by its Triton kernel (as ``moeshard.ep``'s tier: without CUDA, the compiled
    function and ``torch.topk``, and triton is not imported).

    Raises:
        ImportError: the ``"triton"`` tier on a machine with CUDA where triton cannot be imported."""
    from moeshard.ep import compile_rows_dynamic

    for layer in model.model.layers:
        # At the call site, from outside (the bound method, compiled): every layer shares one graph. Kept in the
        # layer's execution, which its forward reads.
        layer.execution = dataclasses.replace(layer.execution, attention_half=torch.compile(layer.attention_half))
    # The final norm, which no layer's graph holds: eager, its float32 statistics are ~8 kernels over the
    # [tokens, D] rows forward and ~15 backward; compiled, one pass each way. nn.Module.compile: the module's call
    # compiled in place (FQNs unchanged).
    model.model.norm.compile()
    head = model.lm_head
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
        # The gradient over the chunk's logits: one [C, V] buffer.
        head.options = dataclasses.replace(head.options, chunk_loss=ce_chunk_triton_)
        for layer in model.model.layers:
            for module in layer.modules():
                if isinstance(module, TopKRouter):  # the selection by the kernel (an opaque op in the compiled half)
                    module.selection = module.selection.replace(kernel=topk_ids_op)
    else:
        head.options = dataclasses.replace(head.options, chunk_loss=compile_rows_dynamic(head.options.chunk_loss))


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


def _with_adapters(plan, model: nn.Module):
    """``plan`` whose EP part also names the LoRA adapters of its expert tensors (``<param>_lora_A [E, r, in]``,
    ``<param>_lora_B [E, out, r]``, see ``moeshard.lora``): sharded on dim 0 with their experts."""
    names = {n for n, _ in model.named_parameters()}
    extra = {}
    for pattern, placement in plan.ep_plan.items():
        for suffix in ("_lora_A", "_lora_B"):
            if any(fqn_matches(pattern + suffix, n) for n in names):
                extra[pattern + suffix] = placement
    return dataclasses.replace(plan, ep_plan={**plan.ep_plan, **extra}) if extra else plan
