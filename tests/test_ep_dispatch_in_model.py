"""moeshard.ep's dispatch protocol in the Qwen3-MoE model: an expert module routes through ``self.dispatch``, and
``apply_ep`` gives every ``Experts`` the dispatcher of its EP group and options (cross-package: ep + the model)."""

import pytest
import torch

from moeshard.ep import EPOptions, LocalDispatch, OverlappedDispatch, apply_ep
from moeshard.ep.testing import reference_routed_experts
from moeshard.meshes import build_meshes, fake_process_group
from moeshard.models.common import Experts
from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config


def _experts(model):
    return [m for m in model.modules() if isinstance(m, Experts)]


def test_experts_route_through_a_local_dispatch_until_apply_ep():
    config = get_preset_config("tiny", num_hidden_layers=2)
    experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    assert type(experts.dispatch) is LocalDispatch and experts.dispatch.num_experts == config.num_experts
    g = torch.Generator().manual_seed(0)
    E, D, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * F, D, generator=g) / D**0.5)
        experts.down_proj.copy_(torch.randn(E, D, F, generator=g) / F**0.5)
    x_TD = torch.randn(6, D, generator=g)
    weights_TK, ids_TK = torch.randn(6, E, generator=g).softmax(-1).topk(config.num_experts_per_tok)
    want = reference_routed_experts(x_TD, ids_TK, weights_TK, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(experts(x_TD, ids_TK, weights_TK), want, rtol=1e-5, atol=1e-5)
    # a layer holding some experts only (loaded with expert_range) runs only after apply_ep
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[:2])
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach()[:2])
    with pytest.raises(ValueError, match="no EP group"):
        experts(x_TD, ids_TK, weights_TK)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_apply_ep_installs_the_dispatchers_of_its_options(ep_size):
    config = get_preset_config("tiny", num_hidden_layers=2)
    options = EPOptions(kernels="compiled", gemm="loop", sm_carveout=8)
    with fake_process_group(4, 3):
        meshes = build_meshes(ep_size=ep_size, device_type="cpu")
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(config)
        info = apply_ep(model, model.get_parallel_plan(), meshes.ep if ep_size > 1 else None, options)
        layers = _experts(model)
        assert len(layers) == 2 and info.options is options
        for experts in layers:
            d = experts.dispatch
            assert type(d) is (OverlappedDispatch if ep_size > 1 else LocalDispatch)
            assert (d.num_experts, d.ep_size, d.options) == (config.num_experts, ep_size, options)
            assert experts.gate_up_proj.shape[0] == config.num_experts // ep_size
        assert layers[0].dispatch.host_sync_hooks is layers[1].dispatch.host_sync_hooks
        assert info.host_sync_hooks is layers[0].dispatch.host_sync_hooks
        info.add_host_sync_hook(lambda: None).remove()
