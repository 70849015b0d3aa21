"""OnePassAdamW without a process group: the same numbers as torch's for-loop AdamW (the clip coefficient read in
the step), checkpoints that move to and from torch's AdamW, the refusals; on CUDA its triton pass over parameters
of any dense layout against the CPU. In the container across two meshes: tests/test_fsdp_moe_qwen3moe_dist.py; in
the EP job with clipping: test_fused_update.py."""

from __future__ import annotations

import copy

import pytest
import torch

from moeshard.fsdp_moe._one_pass_adamw import OnePassAdamW

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(device="cpu"):
    """A matrix, a transposed matrix (dense, not contiguous), a vector and a parameter that gets no gradient."""
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(6, 5, generator=g), torch.randn(4, 7, generator=g).t(), torch.randn(9, generator=g)]
    mats.append(torch.randn(3, generator=g))
    return [torch.nn.Parameter(m.to(device)) for m in mats]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g).to(p.device) for p in params[:-1]]
    out[0] = out[0].t().contiguous().t()  # the gradient in another layout than its parameter
    return [*out, None]


def _run(params, make, steps, coef=None, start=0):
    opt = make(params)
    for s in range(start, start + steps):
        for p, g in zip(params, _grads(params, s), strict=True):
            p.grad = None if g is None else g.clone()
        if coef is None:
            opt.step()
        elif isinstance(opt, OnePassAdamW):
            opt.step(grad_mult=torch.tensor(coef))
        else:  # torch's for-loop AdamW: the clip applied in place first
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
            opt.step()
    return opt


def test_the_same_numbers_as_torch_adamw():
    for coef in (None, 0.37):
        ours, theirs = _params(), _params()
        _run(ours, lambda ps: OnePassAdamW(ps, **HYPER), 3, coef)
        _run(theirs, lambda ps: torch.optim.AdamW(ps, **HYPER, foreach=False), 3, coef)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), (coef, (a - b).abs().max())
        assert not torch.equal(ours[0], _params()[0]) and torch.equal(ours[-1], _params()[-1])


def test_checkpoints_move_to_and_from_torch_adamw():
    ours = _params()
    opt = _run(ours, lambda ps: OnePassAdamW(ps, **HYPER), 2)
    state = opt.state_dict()
    assert sorted(state["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    assert state["state"][0]["step"].device.type == "cpu" and 3 not in state["state"]

    # ours -> torch's, then one more step each: the same
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = torch.optim.AdamW(theirs, **HYPER, foreach=False)
    torch_opt.load_state_dict(copy.deepcopy(state))  # (a state dict aliases the state)
    _run(theirs, lambda ps: torch_opt, 1, start=2)
    _run(ours, lambda ps: opt, 1, start=2)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)

    # torch's -> ours, its step a device-free CPU scalar after the load
    back = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    again = OnePassAdamW(back, **HYPER)
    again.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _run(back, lambda ps: again, 1, start=3)
    _run(theirs, lambda ps: torch_opt, 1, start=3)
    for a, b in zip(back, theirs, strict=True):
        assert torch.equal(a, b)
    assert float(again.state[back[0]]["step"]) == 4.0


def test_one_memory_order_for_the_triton_pass():
    """What the CUDA step hands the kernel: 1-D views of the parameter, gradient and moments that pair the same
    elements, for any dense layout; None where the parameter is not dense or a moment's layout differs."""
    from moeshard.fsdp_moe._one_pass_adamw import _same_layout

    base = torch.arange(24.0).reshape(2, 3, 4)
    for param in (base, base.permute(2, 0, 1), base[:1].transpose(1, 2), base.reshape(6, 4).t()):
        for grad in (param.contiguous(), param.transpose(0, -1).contiguous().transpose(0, -1), param * 1):
            moments = (torch.zeros_like(param), torch.zeros_like(param))
            views = _same_layout(param, grad, *moments)
            assert views is not None and all(v.dim() == 1 and v.numel() == param.numel() for v in views)
            assert torch.equal(views[0], views[1]), (param.stride(), grad.stride())  # the same element pairs
            assert views[2].data_ptr() == moments[0].data_ptr()  # views, not copies
    assert _same_layout(base[:, :, ::2], base[:, :, ::2], *(torch.zeros(2, 3, 2),) * 2) is None  # not dense
    assert _same_layout(base.permute(2, 0, 1), base, torch.zeros(4, 2, 3), torch.zeros(4, 2, 3)) is None


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="float32 parameters"):
        OnePassAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    opt = OnePassAdamW([torch.nn.Parameter(torch.zeros(3))])
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"OnePassAdamW: .*{flag}"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], flag: True})
    with pytest.raises(ValueError, match="tensor lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(0.1)})
    assert len(opt.param_groups) == 1  # a refused group is not kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_pass_on_cuda_equals_the_cpu():
    pytest.importorskip("triton")
    for coef in (None, 0.37):
        cpu, gpu = _params(), _params("cuda")
        assert not gpu[1].is_contiguous()
        _run(cpu, lambda ps: OnePassAdamW(ps, **HYPER), 3, coef)
        _run(gpu, lambda ps: OnePassAdamW(ps, **HYPER), 3, coef)
        for a, b in zip(gpu, cpu, strict=True):
            torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=2e-6, atol=1e-7)
