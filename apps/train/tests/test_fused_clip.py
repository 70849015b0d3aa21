"""train_step's clipping through the optimizer container: torch's fused AdamW (the GPU job's) against the CPU job's.

Two gloo ranks (EP 2, so the experts stay out of FSDP): the same job trained for a few steps with
``build_optimizer(..., fused=True, fuse_local_experts=False)`` (torch's fused AdamW for every parameter; the clip
coefficient may be applied inside the container's step) and with the CPU job's own container (torch's for-loop
AdamW beside ``LocalExpertAdamW`` for the experts) ends with the same parameters and the same gradient norms.
"""

from __future__ import annotations

import pytest
import torch

from moeshard.meshes.testing import run_distributed

STEPS, MAX_NORM = 3, 0.05


def _train(fused: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moeshard.data import DataConfig, StepBatches, open_dataset
    from moeshard.fsdp_moe import build_optimizer, get_state_dict
    from moeshard.train.config import load_config, resolve_model_config
    from moeshard.train.run import build, init_distributed, lr_at, train_step

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
    if fused:  # the job's own container leaves the experts to torch's AdamW: it may be replaced
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fuse_local_experts=False))
    job = build(cfg, device, resolve_model_config(cfg))
    if fused:
        t = cfg.train
        opt = build_optimizer(
            job.model, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=True, fuse_local_experts=False
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, cfg) / t.lr)
        job = dataclasses.replace(job, optimizer=opt, scheduler=sched)
    rows = open_dataset(DataConfig(synthetic=True, seq_len=16, seed=7), vocab_size=job.model_config.vocab_size)
    batches = StepBatches(rows, global_batch=4, world_size=2, micro_batch=1)
    norms = []
    for step in range(STEPS):
        norms.append(train_step(job, batches.micro_batches(step, dist.get_rank())).read().grad_norm)
    sd = get_state_dict(job.model, job.optimizer)["model"]
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}
    return params, norms


def _both() -> tuple:
    return _train(fused=True), _train(fused=False)


def test_fused_adamw_applies_the_clip_of_train_step():
    (fused, fused_norms), (loop, loop_norms) = run_distributed(_both, 2)[0]
    assert min(loop_norms) > 5 * MAX_NORM  # clipping was active every step
    assert fused_norms == pytest.approx(loop_norms, rel=1e-5)
    for name, ref in loop.items():
        err = float((fused[name] - ref).norm() / ref.norm())
        assert err <= 1e-6, f"{name}: relative error in norm {err:.2e}"
