"""EPOptions validation, the kernel tiers, and options kept per model (nothing process-wide)."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from moeshard.ep import EPOptions, LocalDispatch, apply_ep
from moeshard.ep import _kernels as k
from moeshard.ep._dispatch import make_dispatch
from moeshard.ep.testing import ToyMoE, count_host_syncs, toy_plan

# T tokens, K top-k, D hidden, E experts, F expert width


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dispatch": "tokens"}, r"EPOptions.dispatch='tokens' is not one of \('overlapped', 'all_to_all'\).*removed"),
        ({"dispatch": "copies"}, r"EPOptions.dispatch='copies' is not one of \('overlapped', 'all_to_all'\)"),
        ({"kernels": "inductor"}, r"EPOptions.kernels='inductor' is not one of \('eager', 'compiled', 'triton'\)"),
        ({"kernels": True}, r"EPOptions.kernels=True is not one of"),
        ({"gemm": "cutlass"}, r"EPOptions.gemm='cutlass' is not one of \('auto', 'grouped_mm', 'loop'\)"),
        ({"sm_carveout": -1}, r"EPOptions.sm_carveout=-1 is not allowed: an int >= 0"),
        ({"sm_carveout": 1.5}, r"EPOptions.sm_carveout=1.5 is not allowed"),
        ({"sm_carveout": True}, r"EPOptions.sm_carveout=True is not allowed"),
        ({"recompute": "all"}, r"EPOptions.recompute='all' is not one of \('none', 'activation', 'mlp'\)"),
    ],
)
def test_every_field_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EPOptions(**kwargs)


def test_every_field_explains_itself():
    """Each field's ``help`` is the one line front ends print; its limits are its ``Literal`` and ``__post_init__``."""
    import typing

    hints = typing.get_type_hints(EPOptions)
    for f in dataclasses.fields(EPOptions):
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], f.name
        for choice in typing.get_args(hints[f.name]):  # every choice of a field is explained in its help
            assert f'`"{choice}"`' in f.metadata["help"], (f.name, choice)


def test_frozen_and_described():
    options = EPOptions(kernels="triton", sm_carveout=0)
    assert options.describe() == "dispatch=overlapped kernels=triton gemm=auto sm_carveout=0 recompute=none"
    assert EPOptions().describe() == "dispatch=overlapped kernels=eager gemm=auto sm_carveout=32 recompute=none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kernels = "eager"
    assert options == EPOptions(kernels="triton", sm_carveout=0) and hash(options) == hash(
        EPOptions(kernels="triton", sm_carveout=0)
    )


def test_kernel_tiers_are_built_once_and_never_change():
    eager = k.kernels_for("eager")
    assert k.kernels_for("eager") is eager  # cached per tier
    assert (eager.tier, eager.gated, eager.weighted_gated) == ("eager", k.gated, k.weighted_gated)
    compiled = k.kernels_for("compiled")
    assert compiled.gated.__wrapped__ is k.gated and compiled.expand_rows is k.expand_rows
    with pytest.raises(dataclasses.FrozenInstanceError):
        eager.gated = compiled.gated
    with pytest.raises(ValueError, match="kernel tier 'fast' is not one of"):
        k.kernels_for("fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA the triton tier is the compiled one")
def test_triton_tier_without_cuda_is_the_compiled_one():
    triton, compiled = k.kernels_for("triton"), k.kernels_for("compiled")
    assert triton.tier == "triton"
    assert dataclasses.replace(triton, tier="compiled") == compiled


def test_make_dispatch_without_a_group_is_local():
    d = make_dispatch(8, None, EPOptions(dispatch="all_to_all", gemm="loop"))
    assert type(d) is LocalDispatch and d.options.gemm == "loop"
    with pytest.raises(ValueError, match="options must be an EPOptions, got str"):
        make_dispatch(8, None, "overlapped")


def _run(model, x_TD):
    x_TD = x_TD.clone().requires_grad_(True)
    with count_host_syncs() as syncs:
        y_TD = model(x_TD)
    y_TD.square().sum().backward()
    experts = model.layers[0].mlp.experts
    out = [y_TD.detach(), x_TD.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]
    model.zero_grad(set_to_none=True)
    return out, dict(syncs)


def test_two_models_with_different_options_do_not_affect_each_other():
    """One model on the loop GEMM with eager kernels, one on grouped_mm with compiled kernels, in one process."""
    torch.manual_seed(0)
    plain, fast = ToyMoE(num_experts=4, hidden=16, width=8), ToyMoE(num_experts=4, hidden=16, width=8)
    fast.load_state_dict(plain.state_dict())
    apply_ep(plain, toy_plan(), None, EPOptions(gemm="loop"))
    apply_ep(fast, toy_plan(), None, EPOptions(gemm="grouped_mm", kernels="compiled"))
    x_TD = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))

    for model, tier in ((plain, "eager"), (fast, "compiled")):
        assert all(layer.mlp.experts.dispatch.kernels is k.kernels_for(tier) for layer in model.layers)

    frames = counters["frames"]["total"]
    before, syncs = _run(plain, x_TD)
    assert syncs == {"tolist": 2}  # the loop's row counts, once per layer
    assert counters["frames"]["total"] == frames  # eager: nothing compiled
    got, syncs = _run(fast, x_TD)
    assert syncs == {}  # grouped_mm: device offsets
    assert counters["frames"]["total"] > frames  # the compiled kernels ran
    after, syncs = _run(plain, x_TD)
    assert syncs == {"tolist": 2}
    for a, b, c in zip(before, after, got):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["OverlappedDispatch", "AllToAllDispatch"])
def test_a_distributed_strategy_refuses_ep_size_one(strategy):
    import moeshard.ep as ep

    with pytest.raises(ValueError, match=f"{strategy} runs over an EP group of 2 or more ranks.*make_dispatch"):
        getattr(ep, strategy)(8)
    assert isinstance(make_dispatch(8, None), ep.LocalDispatch)
