"""clip_grad_norm_(..., optimizer=fused AdamW): the clip coefficient goes to the fused kernel as ``grad_scale``
instead of a multiply pass over the gradients. One CPU process (torch's fused AdamW has a CPU kernel); the
sharded case is in test_qwen3moe_dist.py."""

import pytest
import torch
from torch import nn

from moeshard.fsdp_moe import clip_grad_norm_

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
    """``mode``: "into" (hand-over to fused AdamW), "fused" (in-place clip, fused AdamW), "loop" (torch's clip,
    for-loop AdamW). Returns the parameters after each step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=mode != "loop", foreach=False)
    out = []
    for step in range(steps):
        _backward(model, step)
        if clip_steps is None or step in clip_steps:
            if mode == "loop":
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            else:
                norm = clip_grad_norm_(model, MAX_NORM, optimizer=opt if mode == "into" else None)
            assert norm > 5 * MAX_NORM  # clipping is active
        opt.step()
        assert not hasattr(opt, "grad_scale")
        opt.zero_grad(set_to_none=True)
        out.append(_params(model))
    return out


@pytest.mark.parametrize("reference", ["fused", "loop"])
def test_handover_gives_the_parameters_of_an_in_place_clip(reference):
    into, ref = _train("into"), _train(reference)
    for step, (a, b) in enumerate(zip(into, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=f"step {step}")
    # Without the coefficient the parameters move differently: the comparison above can fail.
    unclipped = _train("fused", clip_steps=())
    assert (unclipped[-1] - ref[-1]).abs().max() > 1e-3


def test_gradients_untouched_until_the_step_then_clipped_and_the_scale_gone():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=True)
    _backward(model, 0)
    raw = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    coef = MAX_NORM / (norm + 1e-6)
    for p, g in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, g)  # no multiply pass
    assert opt.grad_scale.dtype == torch.float32 and opt.grad_scale.shape == ()
    torch.testing.assert_close(opt.grad_scale, 1 / coef)
    opt.step()
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for p, g in zip(model.parameters(), raw, strict=True):
        torch.testing.assert_close(p.grad, g * coef)  # the fused kernel stores the clipped gradient back


def test_steps_without_a_clip_are_unaffected():
    # Clip (hand-over) on steps 0 and 2 only: steps 1, 3 and 4 see no stale coefficient.
    into = _train("into", clip_steps={0, 2})
    ref = _train("fused", clip_steps={0, 2})
    for step, (a, b) in enumerate(zip(into, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=f"step {step}")


def test_clipping_twice_before_the_step_applies_the_coefficient_once():
    model, ref = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAM, fused=True)
    _backward(model, 0)
    _backward(ref, 0)
    clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    clip_grad_norm_(model, MAX_NORM, optimizer=opt)  # replaces the first hand-over
    clip_grad_norm_(ref, MAX_NORM)
    opt.step()
    ref_opt.step()
    torch.testing.assert_close(_params(model), _params(ref), rtol=1e-6, atol=1e-7)


def test_other_optimizers_get_the_in_place_multiply():
    for kwargs in (dict(foreach=True), dict(foreach=False)):
        model, ref = _model(), _model()
        opt = torch.optim.AdamW(model.parameters(), **ADAM, **kwargs)
        _backward(model, 0)
        _backward(ref, 0)
        assert torch.equal(clip_grad_norm_(model, MAX_NORM, optimizer=opt), clip_grad_norm_(ref, MAX_NORM))
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # bit for bit the path without optimizer=
        assert not hasattr(opt, "grad_scale") and not opt._optimizer_step_pre_hooks
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    clip_grad_norm_(model, MAX_NORM, optimizer=sgd)
    assert not hasattr(sgd, "grad_scale")


def test_stale_or_replaced_hand_over_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM, fused=True)

    def stale(change):
        _backward(model, 0)
        clip_grad_norm_(model, MAX_NORM, optimizer=opt)
        change()
        with pytest.raises(RuntimeError, match="gradients changed"):
            opt.step()
        assert not hasattr(opt, "grad_scale")
        opt.zero_grad(set_to_none=True)

    def new_backward():
        opt.zero_grad(set_to_none=True)
        _backward(model, 1)

    stale(new_backward)
    stale(lambda: opt.zero_grad(set_to_none=False))
    stale(lambda: clip_grad_norm_(model, MAX_NORM))  # an in-place clip on top: the coefficient twice

    _backward(model, 0)
    clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    opt.grad_scale = torch.tensor(2.0)  # what torch.amp.GradScaler does around its step
    with pytest.raises(RuntimeError, match="grad_scale was replaced"):
        opt.step()
    with pytest.raises(ValueError, match="already has a grad_scale"):
        clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    del opt.grad_scale

    # After the refusals a clip and step work as usual.
    clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    opt.step()
    assert not hasattr(opt, "grad_scale")


def test_optimizer_over_other_parameters_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model[0].parameters(), **ADAM, fused=True)
    _backward(model, 0)
    raw = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"steps 0 parameter\(s\).* and 2 clipped one\(s\) it does not step"):
        clip_grad_norm_(model, MAX_NORM, optimizer=opt)
    assert not hasattr(opt, "grad_scale")
    for p, g in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, g)  # nothing clipped either
