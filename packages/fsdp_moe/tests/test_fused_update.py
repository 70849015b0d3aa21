"""fuse_local_expert_updates: the fused AdamW update of the experts kept out of FSDP (EP 2 x ep_fsdp 1, gloo).

The update's numbers against torch's AdamW over whole runs are in test_experts_one_rank.py; here: the triton kernel
against the tensor operations (under triton's interpreter on CPU, a child process; compiled on CUDA), the kept
compute copies across a checkpoint load, ``zero_grad``, and the errors for what the fused update cannot do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moeshard.meshes.testing import run_distributed


def _case(n, grad_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 3).to(grad_dtype)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    return p, grad, m, v


def check_kernel(device: str) -> int:
    """The triton kernel against the CPU tensor operations (torch's for-loop AdamW), for a few variants."""
    from moeshard.fsdp_moe import _triton
    from moeshard.fsdp_moe._fused_update import _update
    from moeshard.fsdp_moe._local_experts import PendingGrad

    cases = 0
    for n, grad_dtype, scale, mult, gs, step in [
        (5000, torch.bfloat16, 0.5, None, None, 1),  # a partial last block
        (4096, torch.bfloat16, 0.25, 0.7, 2.5, 7),  # clipped in place and handed over at once
        (3001, torch.float32, 1.0, None, 1.7, 3),  # an accumulated float32 gradient
    ]:
        kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        p, grad, m, v = _case(n, grad_dtype, seed=n)
        ref = [t.clone() for t in (p, m, v)]
        ref_copy = torch.empty(n, dtype=torch.bfloat16)
        pg = PendingGrad(grad.clone(), scale)
        pg.mult = torch.tensor(mult) if mult is not None else None
        _update(*ref[:1], pg, *ref[1:], ref_copy, torch.tensor(gs) if gs is not None else None, **kw)

        got = [t.clone().to(device) for t in (p, m, v)]
        copy = torch.empty(n, dtype=torch.bfloat16, device=device)
        bc1, bc2 = 1 - 0.9**step, 1 - 0.95**step
        _triton.adamw_update(
            got[0],
            grad.to(device),
            got[1],
            got[2],
            copy,
            scale,
            pg.mult.to(device) if pg.mult is not None else None,
            torch.tensor(gs, device=device) if gs is not None else None,
            decay=1 - 3e-3 * 0.1,
            beta1=0.9,
            beta2=0.95,
            step_size=3e-3 / bc1,
            bias_correction2_sqrt=bc2**0.5,
            eps=1e-8,
        )
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=2e-6, atol=1e-7, msg=lambda s, x=name: f"{x}: {s}")
        assert not torch.equal(got[0].cpu(), p), "the parameter did not move"
        # The copy is the new parameter, cast: exactly on the GPU; within one bf16 step under the interpreter, whose
        # float32 -> bfloat16 conversion truncates instead of rounding to nearest.
        exact = device != "cpu"
        torch.testing.assert_close(copy.cpu().float(), ref_copy.float(), rtol=8e-3, atol=0)
        torch.testing.assert_close(
            copy.cpu(), got[0].cpu().to(torch.bfloat16), rtol=0 if exact else 8e-3, atol=0 if exact else 1e-30
        )
        cases += 1
    # The clipping norm's sum of squares: factors and clip multipliers applied per tensor.
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.randn(n, generator=g).to(dt)
        for n, dt in ((20000, torch.bfloat16), (5, torch.float32), (0, torch.bfloat16))
    ]
    mult = torch.tensor(0.3)
    want = sum(f * float(x.double().square().sum()) for f, x in zip((0.25, 0.09, 1.0), xs))
    got = _triton.sum_of_squares([x.to(device) for x in xs], [0.25, 1.0, 1.0], [None, mult.to(device), None])
    assert got.dtype == torch.float32 and abs(got.item() - want) <= 1e-5 * want, (got.item(), want)
    return cases + 1


def test_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # decided when triton is first imported: a fresh process
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked 4 cases" in run.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda():
    pytest.importorskip("triton")
    assert check_kernel("cuda") == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_clip_norm_of_pending_gradients_on_cuda():
    """The clipping's local norms with pending gradients on CUDA (one triton entry) square-sum to the norm of the
    gradients as unfused, float32, computes it."""
    pytest.importorskip("triton")
    from moeshard.fsdp_moe._clip import _local_norms
    from moeshard.fsdp_moe._local_experts import PendingGrad

    g = torch.Generator().manual_seed(1)
    a = PendingGrad(torch.randn(300_000, generator=g).to("cuda", torch.bfloat16), 0.5)
    b = PendingGrad(torch.randn(7, 3, generator=g).cuda(), 1.0)
    b.mult = torch.tensor(0.25, device="cuda")
    plain = torch.randn(1000, generator=g).cuda()
    norms = _local_norms([a, plain, b], 2.0)
    assert len(norms) == 2  # the pending ones as one entry
    got = torch.stack(norms).square().sum().sqrt().item()
    want = torch.cat([a.materialize(torch.float32).flatten(), plain, b.materialize(torch.float32).flatten()])
    assert abs(got - want.double().norm().item()) <= 1e-5 * got


# ---- on the toy model, EP 2 x ep_fsdp 1 on 2 gloo processes ------------------------------------------------------


def _toy(seed, fuse=True, **opt_kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import fuse_local_expert_updates, shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=2, device_type="cpu")
    torch.manual_seed(seed)
    model = ToyMoELM()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = shard_model(model, meshes, mp_policy=mp)
    assert units.local_experts
    opt = torch.optim.AdamW(model.parameters(), **{"lr": 1e-2, "weight_decay": 0.1, **opt_kw})
    n = fuse_local_expert_updates(model, opt) if fuse else 0
    return meshes, model, opt, n


def _step(model, opt, meshes, seed, *, step=True):
    from moeshard.fsdp_moe import clip_grad_norm_

    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(seed)).chunk(meshes.world_size)
    model(ids[meshes.rank], ids[meshes.rank]).backward()
    clip_grad_norm_(model, 0.05, optimizer=opt)
    if step:
        opt.step()
        opt.zero_grad()


def _params(model):
    from moeshard.fsdp_moe.testing import full_tensors

    return {k: v.clone() for k, v in full_tensors(model).items()}


def _states(model):
    from moeshard.fsdp_moe._local_experts import local_experts_state

    return [st for m in model.modules() if (st := local_experts_state(m)) is not None]


def _checkpoint_and_zero_grad(path):
    from moeshard.fsdp_moe import expert_grad, load_checkpoint, save_checkpoint

    out = {}
    meshes, model, opt, n = _toy(0)
    out["fused"] = n
    for s in range(2):
        _step(model, opt, meshes, seed=s)
    save_checkpoint(path, model, opt)
    _step(model, opt, meshes, seed=2)
    want = _params(model)

    # Another model whose kept copies belong to other weights when the checkpoint is loaded into it.
    meshes, model, opt, _ = _toy(5)
    _step(model, opt, meshes, seed=9, step=False)
    opt.zero_grad()  # drops the pending gradients too
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    out["pending after zero_grad"] = [expert_grad(p) is not None for p in experts]
    out["copies before load"] = sum(len(st.copies) for st in _states(model))
    load_checkpoint(path, model, opt)
    _step(model, opt, meshes, seed=2)
    got = _params(model)
    out["max diff after load"] = max((got[k] - want[k]).abs().max().item() for k in want)
    out["copies match"] = all(
        torch.equal(copy, local.to(copy.dtype)) for st in _states(model) for copy, local, _ in st.copies.values()
    )
    return out


def test_checkpoint_load_and_zero_grad(tmp_path):
    """A checkpoint loaded into a fused model: the kept copies of the old weights are not used (the next step
    equals the saving model's next step exactly); zero_grad drops pending gradients."""
    for out in run_distributed(_checkpoint_and_zero_grad, 2, str(tmp_path / "ckpt")):
        assert out["fused"] == 4
        assert out["pending after zero_grad"] == [False] * 4
        assert out["copies before load"] == 4
        assert out["max diff after load"] == 0.0
        assert out["copies match"]


def _other_optimizer():
    import warnings

    meshes, ref, ref_opt, _ = _toy(0, fuse=False)
    _step(ref, ref_opt, meshes, seed=1)
    meshes, model, _, n = _toy(0)  # fused into an optimizer that never steps
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # built afterwards
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, opt, meshes, seed=1)
    want, got = _params(ref), _params(model)
    return n, max((got[k] - want[k]).abs().max().item() for k in want), [str(w.message) for w in caught]


def test_another_optimizer_still_updates_the_experts():
    """An optimizer other than the fused one gets the pending gradients as param.grad: the same step as unfused."""
    for n, diff, warned in run_distributed(_other_optimizer, 2):
        assert n == 4 and diff == 0.0
        assert any("other than the one passed to fuse_local_expert_updates" in w for w in warned), warned


def _errors():
    from moeshard.fsdp_moe import fuse_local_expert_updates

    out = {}

    def catch(fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    meshes, model, _, _ = _toy(0, fuse=False)
    out["sgd"] = catch(lambda: fuse_local_expert_updates(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    out["amsgrad"] = catch(
        lambda: fuse_local_expert_updates(model, torch.optim.AdamW(model.parameters(), lr=0.1, amsgrad=True))
    )
    out["l2"] = catch(
        lambda: fuse_local_expert_updates(model, torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=0.1))
    )
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    out["subset"] = catch(lambda: fuse_local_expert_updates(model, torch.optim.AdamW(dense, lr=0.1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    out["first"] = fuse_local_expert_updates(model, opt)
    out["twice"] = catch(lambda: fuse_local_expert_updates(model, opt))
    out["other optimizer"] = catch(lambda: fuse_local_expert_updates(model, torch.optim.AdamW(model.parameters())))
    _step(model, opt, meshes, seed=1, step=False)
    expert = next(p for n, p in model.named_parameters() if ".experts." in n)
    expert.grad = torch.zeros_like(expert)
    out["both"] = catch(opt.step)
    return out


def test_errors_name_the_problem():
    for out in run_distributed(_errors, 2):
        assert out["first"] == 4
        assert out["sgd"].startswith("TypeError") and "SGD" in out["sgd"]
        assert out["amsgrad"].startswith("ValueError") and "amsgrad" in out["amsgrad"]
        assert "L2 weight decay" in out["l2"]
        assert "is not among the optimizer's parameters" in out["subset"]
        assert "fused already" in out["twice"]
        assert "another optimizer" in out["other optimizer"]
        assert out["both"].startswith("RuntimeError") and "both a pending gradient" in out["both"]


def _nothing_to_fuse():
    from moeshard.ep import apply_ep
    from moeshard.fsdp_moe import fuse_local_expert_updates, shard_model
    from moeshard.fsdp_moe.testing import ToyMoELM
    from moeshard.meshes import build_meshes

    meshes = build_meshes(ep_size=1, device_type="cpu")  # EP 1 x ep_fsdp 2: the experts are FSDP units
    model = ToyMoELM()
    apply_ep(model, model.get_parallel_plan(), meshes.ep)
    shard_model(model, meshes)
    return fuse_local_expert_updates(model, torch.optim.AdamW(model.parameters()))


def test_nothing_to_fuse_under_expert_fsdp():
    assert run_distributed(_nothing_to_fuse, 2) == [0, 0]


if __name__ == "__main__":  # the interpreter run of test_kernel_in_the_interpreter
    print(f"checked {check_kernel('cpu')} cases")


def _late_pre_hook():
    # A step pre-hook registered after fuse_local_expert_updates that changes the learning rate: the experts'
    # update must see it, as an unfused optimizer's would (the fused update then waits for the post-hook).
    def lower_lr(opt, args, kwargs):
        for group in opt.param_groups:
            group["lr"] = 3e-3

    meshes, ref, ref_opt, _ = _toy(0, fuse=False)
    ref_opt.register_step_pre_hook(lower_lr)
    meshes, model, opt, n = _toy(0)
    opt.register_step_pre_hook(lower_lr)
    for s in range(2):
        _step(ref, ref_opt, meshes, seed=s)
        _step(model, opt, meshes, seed=s)
    want, got = _params(ref), _params(model)
    rel = max((got[k] - want[k]).abs().max().item() / want[k].abs().max().item() for k in want)
    # Which path each took: the late hook defers the update; with only the clip hand-over's check registered after
    # it (what _step's clip_grad_norm_(..., optimizer=opt) adds) the update runs first, in the pre-hook.
    meshes, plain, plain_opt, _ = _toy(0)
    _step(plain, plain_opt, meshes, seed=0)
    from moeshard.fsdp_moe._fused_update import _HOOK_ATTR

    late, plain_hook = getattr(opt, _HOOK_ATTR)[0], getattr(plain_opt, _HOOK_ATTR)[0]
    return n, rel, late._last_pre_hook(opt), plain_hook._last_pre_hook(plain_opt)


def test_a_later_step_pre_hook_still_reaches_the_expert_update():
    for n, rel, late_first, plain_first in run_distributed(_late_pre_hook, 2):
        assert n == 4 and rel < 1e-6, rel
        assert not late_first and plain_first
