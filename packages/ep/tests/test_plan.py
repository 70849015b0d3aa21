"""ParallelPlan validation and apply_ep on a toy MoE, on meta and materialised, EP 1 and EP 2 (fake backend):
the expert slices, the metadata and the dispatchers it installs."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from moeshard.ep import (
    AllToAllDispatch,
    EPOptions,
    LocalDispatch,
    OverlappedDispatch,
    ParallelPlan,
    apply_ep,
    fqn_matches,
)
from moeshard.ep._plan import ep_group, find_expert_modules, is_expert_module
from moeshard.ep.testing import ToyMoE, toy_plan
from moeshard.meshes import build_meshes, fake_process_group

E, D, F = 8, 16, 4
EXPERTS = ("layers.0.mlp.experts", "layers.1.mlp.experts")


def test_fqn_matches_one_segment_per_star():
    assert fqn_matches("layers.*.mlp.experts.w", "layers.0.mlp.experts.w")
    assert fqn_matches("layers.*.mlp.*.w", "layers.12.mlp.experts.w")
    assert not fqn_matches("layers.*.mlp.experts.w", "layers.0.1.mlp.experts.w")  # never two segments
    assert not fqn_matches("layers.*.mlp.experts.w", "layers.mlp.experts.w")  # never zero
    assert not fqn_matches("layers.*", "layers.0.mlp")  # no prefix match
    assert fqn_matches("lm_head", "lm_head")


def test_plan_validation():
    with pytest.raises(ValueError, match=r"ep_plan\['a.w'\] is Shard\(dim=1\).*use Shard\(0\)"):
        ParallelPlan({"a.w": Shard(1)})
    with pytest.raises(ValueError, match="use Shard"):
        ParallelPlan({"a.w": Replicate()})
    with pytest.raises(ValueError, match="'\\*' must be a whole segment"):
        ParallelPlan({"layers.x*.w": Shard(0)})
    with pytest.raises(ValueError, match="empty segment"):
        ParallelPlan({"layers..w": Shard(0)})
    with pytest.raises(ValueError, match="fsdp_units must be a tuple"):
        ParallelPlan({"a.w": Shard(0)}, fsdp_units="layers.*")
    assert ParallelPlan({"a.w": Shard(0)}, fsdp_units=["a", "b.*"]).fsdp_units == ("a", "b.*")


def test_ep1_records_metadata_and_slices_nothing():
    model = ToyMoE(num_experts=E, hidden=D, width=F)
    before = model.layers[0].mlp.experts.gate_up_proj
    info = apply_ep(model, toy_plan(), None)
    assert (info.ep_size, info.ep_rank, info.expert_modules) == (1, 0, EXPERTS)
    assert list(info.params) == [
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.experts.down_proj",
        "layers.1.mlp.experts.gate_up_proj",
        "layers.1.mlp.experts.down_proj",
    ]
    meta = info.params["layers.1.mlp.experts.down_proj"]
    assert (meta.global_shape, meta.expert_start, meta.expert_end) == ((E, D, F), 0, E)
    assert model.layers[0].mlp.experts.gate_up_proj is before
    assert info.module_names(model) == [(n, model.get_submodule(n)) for n in EXPERTS]
    assert ep_group(model.layers[0].mlp.experts) is None
    assert is_expert_module(model.layers[1].mlp.experts) and not is_expert_module(model.layers[1].mlp)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("rank", [0, 3])
def test_ep2_keeps_this_ranks_experts(device, rank):
    torch.manual_seed(0)
    full = ToyMoE(num_experts=E, hidden=D, width=F)
    with fake_process_group(4, rank):
        meshes = build_meshes(ep_size=2, ranks_per_node=4, device_type="cpu")  # ep rank = rank % 2
        with torch.device(device):
            torch.manual_seed(0)
            model = ToyMoE(num_experts=E, hidden=D, width=F)
        info = apply_ep(model, toy_plan(), meshes.ep)
        ep_rank = rank % 2
        assert (info.ep_size, info.ep_rank, info.expert_modules) == (2, ep_rank, EXPERTS)
        start, end = 4 * ep_rank, 4 * ep_rank + 4
        for fqn, meta in info.params.items():
            p = model.get_parameter(fqn)
            assert type(p) is nn.Parameter and p.requires_grad and p.device.type == device
            assert meta.local_shape == tuple(p.shape) == (E // 2, *meta.global_shape[1:])
            assert (meta.ep_size, meta.ep_rank, meta.expert_start, meta.expert_end) == (2, ep_rank, start, end)
            if device == "cpu":
                assert torch.equal(p, full.get_parameter(fqn)[start:end])
                assert p.untyped_storage().nbytes() == p.numel() * p.element_size()  # a copy, not a view
        assert model.layers[0].mlp.gate.weight.shape == (E, D)  # the router is not an expert
        for name, module in find_expert_modules(model):
            assert name in EXPERTS and ep_group(module) is meshes.ep.get_group()


def test_errors_name_the_problem():
    model = ToyMoE(num_experts=6, hidden=D, width=F)
    with pytest.raises(ValueError, match=r"'layers\.\*\.experts\.w' matches no parameter of ToyMoE"):
        apply_ep(model, ParallelPlan({"layers.*.experts.w": Shard(0)}), None)
    with fake_process_group(4, 0):
        meshes = build_meshes(ep_size=4, device_type="cpu")
        with pytest.raises(
            ValueError,
            match=r"layers\.0\.mlp\.experts\.gate_up_proj has dim 0 of size 6, not divisible by the EP size 4",
        ):
            apply_ep(model, toy_plan(), meshes.ep)
        assert (
            not any(map(is_expert_module, model.modules())) and model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
        )  # untouched
        with pytest.raises(ValueError, match="1-D EP mesh, got a 2-D mesh"):
            apply_ep(model, toy_plan(), meshes.expert)
    apply_ep(model, toy_plan(), None)
    with pytest.raises(ValueError, match="already applied"):
        apply_ep(model, toy_plan(), None)


def test_dtensor_parameter_is_refused():
    from torch.distributed.tensor import distribute_tensor

    with fake_process_group(2, 0):
        meshes = build_meshes(ep_size=1, device_type="cpu")
        model = ToyMoE(num_layers=1, num_experts=E, hidden=D, width=F)
        experts = model.layers[0].mlp.experts
        experts.down_proj = nn.Parameter(distribute_tensor(experts.down_proj.detach(), meshes.fsdp, [Shard(0)]))
        with pytest.raises(ValueError, match="already a DTensor: apply_ep must run before FSDP"):
            apply_ep(model, toy_plan(), meshes.ep)


def test_ep1_installs_local_dispatchers_with_the_options():
    model = ToyMoE(num_experts=E, hidden=D, width=F)
    del model.layers[1].mlp.experts.dispatch  # a module without the attribute is left alone
    options = EPOptions(gemm="loop", kernels="compiled")
    info = apply_ep(model, toy_plan(), None, options)
    assert info.options is options
    dispatch = model.layers[0].mlp.experts.dispatch
    assert type(dispatch) is LocalDispatch and dispatch.options is options
    assert (dispatch.num_experts, dispatch.ep_size, dispatch.group) == (E, 1, None)
    assert dispatch.kernels.tier == "compiled"
    assert not hasattr(model.layers[1].mlp.experts, "dispatch")
    assert "dispatch" not in dict(model.named_modules())  # a plain attribute, not a submodule
    assert repr(dispatch) == (
        "LocalDispatch(num_experts=8, ep_size=1, dispatch=overlapped kernels=compiled gemm=loop sm_carveout=32 "
        "recompute=none)"
    )


@pytest.mark.parametrize("strategy,cls", [("overlapped", OverlappedDispatch), ("all_to_all", AllToAllDispatch)])
def test_ep2_installs_the_strategy_of_the_options(strategy, cls):
    with fake_process_group(4, 1):
        meshes = build_meshes(ep_size=2, ranks_per_node=4, device_type="cpu")
        with torch.device("meta"):
            model = ToyMoE(num_experts=E, hidden=D, width=F)
        apply_ep(model, toy_plan(), meshes.ep, EPOptions(dispatch=strategy, sm_carveout=0))
        first, second = (layer.mlp.experts.dispatch for layer in model.layers)
        for d in (first, second):
            assert type(d) is cls and d.group is meshes.ep.get_group()
            assert (d.num_experts, d.ep_size, d.ep_rank, d.options.sm_carveout) == (E, 2, 1, 0)
        assert first is not second and first.host_sync_hooks is second.host_sync_hooks  # one per apply_ep call


def test_options_and_hooks_errors():
    model = ToyMoE(num_experts=E, hidden=D, width=F)
    with pytest.raises(ValueError, match="options must be an EPOptions or None, got dict"):
        apply_ep(model, toy_plan(), None, {"dispatch": "overlapped"})
    assert type(model.layers[0].mlp.experts.dispatch) is LocalDispatch  # a failed call changes nothing
    info = apply_ep(model, toy_plan(), None)
    assert model.layers[0].mlp.experts.dispatch.host_sync_hooks is info.host_sync_hooks
    handle = info.add_host_sync_hook(lambda: None)
    handle.remove()
