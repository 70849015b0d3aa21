"""parallelize: its options, the plan it builds at world 16 (fake backend, meta model), and its numbers on gloo, on
the toy family (``moeshard.models.common.testing``).

Gloo runs compare with one process: the loss and every gradient after ``parallelize`` (2 nodes x 2 ranks, EP 2)
equal the plain model's on the global batch, and the compiled model (``compile=True``) equals the eager one and
compiles once, not every step.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

import moeshard.ep
import moeshard.fsdp_moe
import moeshard.prefetch
from moeshard.ep import EPOptions
from moeshard.meshes import build_meshes, fake_process_group
from moeshard.meshes.testing import run_distributed
from moeshard.models.common import (
    Parallelized,
    ParallelOptions,
    ce_chunk,
    load_hf_config,
    load_hf_weights,
    parallelize,
)
from moeshard.models.common.testing import ToyConfig, ToyForCausalLM, check_two_nodes_of_two

# ---- options ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [
        ("ep", "overlapped"),
        ("compile", 1),
        ("activation_checkpointing", "yes"),
        ("activation_checkpointing", None),
        ("selective_recompute", "attention"),
        ("param_dtype", "float16"),
        ("param_dtype", torch.bfloat16),
        ("reshard_after_forward", 0),
        ("expert_reduce_dtype", "float16"),
        ("expert_reduce_dtype", torch.bfloat16),
        ("expert_reshard_after_forward", 0),
        ("expert_reshard_after_forward", "false"),
        ("prefetch_depth", -1),
        ("prefetch_depth", 1.0),
        ("prefetch_depth", True),
        ("prefetch_at_host_sync", 0),
    ],
)
def test_options_refuse_bad_values_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"ParallelOptions\.{name}="):
        ParallelOptions(**{name: value})


def test_resharding_resolves_none_by_the_world_size():
    # None: reshard where the FSDP mesh shards (more than one rank), keep gathered on one rank; experts follow.
    assert ParallelOptions().resharding(1) == (False, False)
    assert ParallelOptions().resharding(16) == (True, True)
    assert ParallelOptions(reshard_after_forward=True).resharding(1) == (True, True)
    assert ParallelOptions(expert_reshard_after_forward=False).resharding(16) == (True, False)


def test_options_are_frozen_and_describe_themselves():
    default = ParallelOptions()
    with pytest.raises(AttributeError):
        default.compile = True  # type: ignore[misc]
    lines = default.describe()
    assert lines[0] == f"ep: {EPOptions().describe()}"
    assert "compile: off" in lines and "activation checkpointing: off" in lines
    assert any(line.startswith("prefetch: depth 1") and "host sync" in line for line in lines)
    text = "\n".join(
        ParallelOptions(
            ep=EPOptions(dispatch="all_to_all"),
            compile=True,
            activation_checkpointing=True,
            param_dtype="bfloat16",
            prefetch_depth=0,
        ).describe()
    )
    for part in ("dispatch=all_to_all", "compile: attention half", "each decoder layer", "bfloat16", "prefetch: off"):
        assert part in text
    assert (
        "param dtype: auto (bfloat16 on CUDA, float32 elsewhere); master weights and gradient reduction float32"
        in lines
    )
    assert "reshard after forward: auto (True, False where the FSDP mesh has one rank)" in lines
    experts = ParallelOptions(
        expert_reduce_dtype="bfloat16", reshard_after_forward=True, expert_reshard_after_forward=False
    ).describe()
    assert any(
        line.endswith("gradient reduction float32, the experts' reduce-scatter bfloat16 (ep_fsdp > 1)")
        for line in experts
    )
    assert "reshard after forward: True, experts False (ep_fsdp > 1)" in experts


def test_checkpointing_policies():
    """``True``/``False`` read as full/none; selective reaches the experts through the EP options, and the
    EP options' own recompute is refused (one place chooses the policy)."""
    assert ParallelOptions(activation_checkpointing=True) == ParallelOptions(activation_checkpointing="full")
    assert ParallelOptions(activation_checkpointing=False).activation_checkpointing == "none"
    for options in (ParallelOptions(), ParallelOptions(activation_checkpointing="full")):
        assert options.ep_options() == options.ep
    selective = ParallelOptions(ep=EPOptions(gemm="loop"), activation_checkpointing="selective")
    assert selective.ep_options() == EPOptions(gemm="loop", recompute="activation")
    lines = ParallelOptions(activation_checkpointing="selective", selective_recompute="mlp").describe()
    assert "activation checkpointing: selective (the routed experts recompute: mlp)" in lines
    assert lines[0].endswith("recompute=mlp")
    refused = r"ParallelOptions.ep.recompute='mlp' is not allowed: set ParallelOptions.activation_checkpointing="
    with pytest.raises(ValueError, match=refused):
        ParallelOptions(ep=EPOptions(recompute="mlp"))


# ---- the plan at world 16 (fake backend, nothing materialised) --------------------------------------------------

_OPTIONS = {
    "defaults": ParallelOptions(),
    "everything": ParallelOptions(
        compile=True,
        activation_checkpointing=True,
        param_dtype="bfloat16",
        reshard_after_forward=False,
        prefetch_depth=2,
    ),
    "no-prefetch": ParallelOptions(prefetch_depth=0),
    "expert-units": ParallelOptions(expert_reduce_dtype="bfloat16", expert_reshard_after_forward=False),
    "selective": ParallelOptions(activation_checkpointing="selective", selective_recompute="activation"),
    "prefetch-in-pre-forward": ParallelOptions(prefetch_at_host_sync=False),
}


def _spy(monkeypatch, module, name: str, calls: list):
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("ep", [1, 4, 8])
@pytest.mark.parametrize("which", list(_OPTIONS))
@pytest.mark.filterwarnings("ignore:DTensor random operators")
def test_plan_at_world_16(monkeypatch, ep, which):
    options = _OPTIONS[which]
    config = ToyConfig()  # 3 layers, layer 1 dense; 8 experts, D 64, F 32
    host_sync_hooks, shard_calls = [], []
    _spy(monkeypatch, moeshard.prefetch, "prefetch_forward_at_host_sync", host_sync_hooks)
    _spy(monkeypatch, moeshard.fsdp_moe, "shard_model", shard_calls)
    with fake_process_group(16, rank=13):
        meshes = build_meshes(ep_size=ep, ranks_per_node=8, device_type="cpu")  # 2 nodes x 8
        with torch.device("meta"):
            model = ToyForCausalLM(config)
        keys = list(model.state_dict())
        par = parallelize(model, meshes, options)

        assert isinstance(par, Parallelized) and par.options is options
        assert (par.ep_info.ep_size, par.ep_info.ep_rank) == (ep, 13 % ep)
        assert list(model.state_dict()) == keys  # FQNs unchanged by every step
        ep_fsdp = 16 // ep
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.to_local().device.type == "meta", name
            if ".mlp.experts." in name:
                global_shape = (8 // ep, 64, 64) if name.endswith("gate_up_proj") else (8 // ep, 64, 32)
                assert param.device_mesh.mesh_dim_names == ("ep_fsdp",) and param.placements == (Shard(1),)
                assert tuple(param.shape) == global_shape, name
                assert tuple(param.to_local().shape) == (8 // ep, 64 // ep_fsdp, global_shape[2]), name
            else:
                assert param.device_mesh.mesh_dim_names == ("fsdp",) and param.placements == (Shard(0),), name

        stages = [[fqn for fqn, _ in stage.modules] for stage in par.units.stages]
        assert stages == [
            ["model.embed_tokens"],
            ["model.layers.0", "model.layers.0.mlp.experts"],
            ["model.layers.1"],
            ["model.layers.2", "model.layers.2.mlp.experts"],
            ["lm_head"],
        ]
        (_, shard_kwargs), *more = shard_calls
        assert not more
        dtype = {"auto": None, "bfloat16": torch.bfloat16}[options.param_dtype]
        # no input cast: it would round the loss's float32 divisor to the compute dtype
        expected_mp = MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=dtype and torch.float32, cast_forward_inputs=False
        )
        assert shard_kwargs == {
            "ep_info": par.ep_info,  # what apply_ep returned, handed on: shard_model never applies EP itself
            "compile": options.compile,
            "mp_policy": expected_mp,
            "reshard_after_forward": options.resharding(16)[0],  # resolved for the world (None: True at 16)
            "expert_reduce_dtype": getattr(torch, options.expert_reduce_dtype),
            "expert_reshard_after_forward": options.resharding(16)[1],
        }
        assert par.keeps_gathered is not any(options.resharding(16))

        if options.prefetch_depth:
            assert par.schedule.depth == options.prefetch_depth and len(par.schedule.stages) == 5
        else:
            assert par.schedule is None
        at_sync = ep > 1 and options.prefetch_depth > 0 and options.prefetch_at_host_sync
        expected_hooks = [(par.schedule, par.ep_info.add_host_sync_hook)] if at_sync else []
        assert [args for args, _ in host_sync_hooks] == expected_hooks  # the hooks of the EPInfo, as an argument

        full = options.activation_checkpointing == "full"
        # Applied from outside as values the modules declare and read: nothing else is set on an instance.
        for layer in model.model.layers:
            assert (layer.execution.checkpoint is not None) == full
            assert (layer.execution.attention_half is not None) == options.compile
            assert "forward" not in vars(layer) and "attention_half" not in vars(layer)
        experts = [m for m in model.modules() if hasattr(m, "dispatch")]
        assert experts and all(m.dispatch.options == options.ep_options() for m in experts)
        assert (model.lm_head.options.chunk_loss is not ce_chunk) == options.compile
        assert type(model.lm_head).options.chunk_loss is ce_chunk  # the class's default is untouched

        with pytest.raises(ValueError):
            parallelize(model, meshes, options)  # once per model


def test_parallelize_refuses_what_it_cannot_parallelize():
    with fake_process_group(2):
        meshes = build_meshes(ep_size=1, device_type="cpu")
        with pytest.raises(TypeError, match="MoECausalLM"):
            parallelize(torch.nn.Linear(2, 2), meshes)
        with torch.device("meta"):
            model = ToyForCausalLM(ToyConfig())
        with pytest.raises(TypeError, match="ParallelOptions"):
            parallelize(model, meshes, {"compile": True})


# ---- numbers on gloo ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        ParallelOptions(),
        ParallelOptions(activation_checkpointing="full", reshard_after_forward=False, prefetch_depth=2),
        # with the experts kept gathered from forward to backward (the other units resharded)
        ParallelOptions(activation_checkpointing="selective", expert_reshard_after_forward=False),
    ],
    ids=["defaults", "checkpointing", "selective-experts-kept"],
)
def test_two_nodes_of_two_at_ep_2_equal_one_process(toy_dir, options):
    reference = ToyForCausalLM.from_pretrained(toy_dir)  # the same model in one process, on the global batch
    check_two_nodes_of_two(ToyForCausalLM, toy_dir, reference, options, output_router_logits=False)


def _compiled_and_eager(path, ids_RSBS):
    """One rank of 2 (EP 2: experts kept out of FSDP): three steps eager, then compiled, then compiled with
    activation checkpointing (the recomputation runs the compiled graph), same data."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    rank = dist.get_rank()
    meshes = build_meshes(ep_size=2, device_type="cpu")
    out = {}
    for name, options in (
        ("eager", ParallelOptions()),
        ("compiled", ParallelOptions(compile=True)),
        ("compiled+checkpointing", ParallelOptions(compile=True, activation_checkpointing=True)),
    ):
        with torch.device("meta"):
            model = ToyForCausalLM(load_hf_config(path, ToyForCausalLM.hf_format))
        par = parallelize(model, meshes, options)
        model.to_empty(device="cpu")
        load_hf_weights(model, path, ep_info=par.ep_info)
        losses, graphs = [], []
        for ids in ids_RSBS[rank]:
            model.zero_grad()
            loss = model(ids, labels=ids, return_logits=False).loss  # the head's chunk loss too
            loss.backward()
            losses.append(loss.detach())
            graphs.append(counters["stats"]["unique_graphs"])
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        out[name] = (losses, grads, graphs)
    return out


def test_compiled_equals_eager_and_compiles_once(toy_dir):
    ids_RSBS = torch.randint(1, 512, (2, 3, 2, 10), generator=torch.Generator().manual_seed(4))
    for out in run_distributed(_compiled_and_eager, 2, toy_dir, ids_RSBS, timeout=600):
        eager_losses, eager_grads, eager_graphs = out["eager"]
        assert eager_graphs == [0, 0, 0]  # nothing compiles without compile=True
        # One graph for the MoE layers' attention half (their router inside), one for the dense layer's, one for
        # the final norm, one for the loss chunk; none added after the first step.
        assert out["compiled"][2] == [4, 4, 4], out["compiled"][2]
        checkpointed_graphs = out["compiled+checkpointing"][2]
        assert checkpointed_graphs[0] == checkpointed_graphs[2], checkpointed_graphs
        for variant in ("compiled", "compiled+checkpointing"):
            losses, grads, _ = out[variant]
            torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-5, atol=1e-5)
            for name, grad in grads.items():
                torch.testing.assert_close(
                    grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=f"{variant} {name}": f"{n}: {m}"
                )
