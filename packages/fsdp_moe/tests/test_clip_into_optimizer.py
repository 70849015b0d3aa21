"""OptimizersContainer.clip_grad_norm_ with torch's fused AdamW: the clip coefficient goes to the fused kernel as
``grad_scale`` inside the container's step instead of a multiply pass over the gradients. One CPU process (torch's
fused AdamW has a CPU kernel); the sharded cases are in test_fused_update.py and tests/test_fsdp_moe_qwen3moe_dist.py.
"""

import pytest
import torch
from torch import nn

from moeshard.fsdp_moe import OptimizersContainer, clip_grad_norm_, get_total_norm

STEPS, MAX_NORM = 5, 0.02  # the gradients' norm is ~0.3: every step clips
ADAM = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


def _backward(model, step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _train(mode, steps=STEPS, clip_steps=None):
    """``mode``: "container" (the container's clip with a fused AdamW: the coefficient in the step), "fused"
    (in-place clip, fused AdamW), "loop" (torch's clip, for-loop AdamW). Returns the parameters after each step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=mode != "loop", foreach=False)
    container = OptimizersContainer([opt])
    out = []
    for step in range(steps):
        _backward(model, step)
        if clip_steps is None or step in clip_steps:
            if mode == "loop":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif mode == "container":
                norm = container.clip_grad_norm_(MAX_NORM)
            else:
                norm = clip_grad_norm_(model, MAX_NORM)
            assert norm > 5 * MAX_NORM  # clipping is active
        container.step()
        assert not hasattr(opt, "grad_scale")
        container.zero_grad()
        out.append(_params(model))
    return out


@pytest.mark.parametrize("reference", ["fused", "loop"])
def test_coefficient_in_the_step_gives_the_parameters_of_an_in_place_clip(reference):
    got, ref = _train("container"), _train(reference)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=f"step {step}")
    # Without the coefficient the parameters move differently: the comparison above can fail.
    unclipped = _train("fused", clip_steps=())
    assert (unclipped[-1] - ref[-1]).abs().max() > 1e-3


def test_gradients_untouched_until_the_step_then_clipped_and_the_scale_gone():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=True)
    container = OptimizersContainer([opt])
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(getattr(o, "grad_scale", None)))
    _backward(model, 0)
    raw = [p.grad.clone() for p in model.parameters()]
    norm = container.clip_grad_norm_(MAX_NORM)
    coef = MAX_NORM / (norm + 1e-6)
    for p, g in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, g)  # no multiply pass
    assert not hasattr(opt, "grad_scale")
    container.step()
    assert len(seen) == 1 and seen[0].dtype == torch.float32 and seen[0].shape == ()
    torch.testing.assert_close(seen[0], 1 / coef)  # torch's fused step divides by it
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for p, g in zip(model.parameters(), raw, strict=True):
        torch.testing.assert_close(p.grad, g * coef)  # the fused kernel stores the clipped gradient back


def test_steps_without_a_clip_are_unaffected():
    # Clip on steps 0 and 2 only: steps 1, 3 and 4 see no stale coefficient.
    got = _train("container", clip_steps={0, 2})
    ref = _train("fused", clip_steps={0, 2})
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=f"step {step}")


def test_clipping_twice_before_the_step_applies_the_coefficient_as_an_in_place_clip_twice():
    model, ref = _model(), _model()
    container = OptimizersContainer([torch.optim.AdamW(model.parameters(), **ADAM, fused=True)])
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM, fused=True)
    _backward(model, 0)
    _backward(ref, 0)
    first = container.clip_grad_norm_(MAX_NORM)
    second = container.clip_grad_norm_(MAX_NORM)  # the norm with the kept coefficient applied: ~max_norm
    assert first > 5 * MAX_NORM and second == pytest.approx(MAX_NORM, rel=1e-4)
    assert get_total_norm(container) == pytest.approx(MAX_NORM, rel=1e-4)
    clip_grad_norm_(ref, MAX_NORM)
    clip_grad_norm_(ref, MAX_NORM)
    container.step()
    ref_opt.step()
    torch.testing.assert_close(_params(model), _params(ref), rtol=1e-6, atol=1e-7)


def test_other_optimizers_get_the_in_place_multiply():
    for kwargs in (dict(foreach=True), dict(foreach=False)):
        model, ref = _model(), _model()
        container = OptimizersContainer([torch.optim.AdamW(model.parameters(), **ADAM, **kwargs)])
        _backward(model, 0)
        _backward(ref, 0)
        assert torch.equal(clip_grad_norm_(container, MAX_NORM), clip_grad_norm_(ref, MAX_NORM))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # bit for bit the in-place clip
        assert container._clip_coefs == [None]


def test_two_children_clip_as_one():
    """A fused AdamW and an SGD over the two layers: one norm over both, each child's step clipped."""
    model, ref = _model(), _model()
    container = OptimizersContainer(
        [torch.optim.AdamW(model[0].parameters(), **ADAM, fused=True), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    )
    ref_opts = [
        torch.optim.AdamW(ref[0].parameters(), **ADAM, fused=True),
        torch.optim.SGD(ref[2].parameters(), lr=0.1),
    ]
    assert [g["lr"] for g in container.param_groups] == [1e-2, 0.1]
    for step in range(3):
        _backward(model, step)
        _backward(ref, step)
        n = container.clip_grad_norm_(MAX_NORM)
        assert torch.equal(n, clip_grad_norm_(ref, MAX_NORM))
        container.step()
        for o in ref_opts:
            o.step()
        container.zero_grad()
        ref.zero_grad()
    torch.testing.assert_close(_params(model), _params(ref), rtol=1e-6, atol=1e-7)
    assert container.state.keys() == {p for o in container.optimizers for p in o.state}


def test_a_grad_scale_of_other_code_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=True)
    container = OptimizersContainer([opt])
    _backward(model, 0)
    raw = [p.grad.clone() for p in model.parameters()]
    opt.grad_scale = torch.tensor(2.0)  # what torch.amp.GradScaler does around its step
    with pytest.raises(ValueError, match="grad_scale or found_inf set by other code"):
        container.clip_grad_norm_(MAX_NORM)
    del opt.grad_scale
    for p, g in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, g)  # nothing clipped
    container.clip_grad_norm_(MAX_NORM)  # after the refusal a clip and step work as usual
    container.step()
    assert not hasattr(opt, "grad_scale")
