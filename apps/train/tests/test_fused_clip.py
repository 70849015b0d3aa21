"""train_step with a fused AdamW (what build_job makes on GPU) leaves the clipping to the optimizer's step.

Two gloo ranks (EP 2): the same job trained for a few steps with the fused AdamW (clip coefficient handed over as
``grad_scale``) and with the CPU job's for-loop AdamW (clip in place) ends with the same parameters.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.meshes.testing import run_distributed

STEPS, MAX_NORM = 3, 0.05


def _train(fused: bool) -> tuple[dict[str, torch.Tensor], list[float], bool]:
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moeshard.fsdp_moe import get_state_dict
    from moeshard.train.config import load_config
    from moeshard.train.data import Batch
    from moeshard.train.trainer import build_job, host_stats, init_distributed, lr_at, train_step

    device = init_distributed()
    cfg = load_config(
        None,
        [
            "--model.overrides.num_hidden_layers=2",
            "--parallel.ep_size=2",
            "--data.seq_len=16",
            "--train.global_batch_size=4",
            "--train.micro_batch_size=1",
            "--train.warmup_steps=0",
            "--train.lr=1e-3",
            f"--train.max_grad_norm={MAX_NORM}",
        ],
    )
    job = build_job(cfg, device)
    if fused:
        t = cfg.train
        opt = torch.optim.AdamW(job.model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / t.lr)
        job = dataclasses.replace(job, optimizer=opt, scheduler=sched)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    vocab = job.model_config.vocab_size
    norms, handed_over = [], True
    for _ in range(STEPS):
        micro = [Batch(ids, ids, None, ()) for ids in torch.randint(0, vocab, (2, 1, 16), generator=g)]
        stats = train_step(job, micro)
        handed_over &= hasattr(job.optimizer, "grad_scale") == fused
        job.optimizer.step()
        handed_over &= not hasattr(job.optimizer, "grad_scale")
        job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
        norms.append(host_stats(stats)["grad_norm"])
    sd = get_state_dict(job.model)["model"]
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}
    return params, norms, handed_over


def _both() -> tuple:
    return _train(fused=True), _train(fused=False)


def test_fused_adamw_applies_the_clip_of_train_step():
    (fused, fused_norms, handed_over), (loop, loop_norms, loop_ok) = run_distributed(_both, 2)[0]
    assert handed_over and loop_ok  # grad_scale set by train_step only with the fused AdamW, gone after the step
    assert min(loop_norms) > 5 * MAX_NORM  # clipping was active every step
    assert fused_norms == pytest.approx(loop_norms, rel=1e-5)
    for name, ref in loop.items():
        err = float((fused[name] - ref).norm() / ref.norm())
        assert err <= 1e-6, f"{name}: relative error in norm {err:.2e}"
