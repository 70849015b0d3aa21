"""``train.gradient_sync``: FSDP reduces the gradients after every micro-batch or only after the last one.

Four gloo ranks as 2 nodes x 2, two layouts: EP 2 x ep_fsdp 2 (experts FSDP-sharded on dim 1) and EP 4 x ep_fsdp 1
(experts out of FSDP, updated by the fused ``LocalExpertAdamW``). In each, the same job from the same seed trains
a few steps of two micro-batches per rank with either setting: the per-step losses and gradient norms and the final
parameters agree to float32 rounding, and ``last_micro_batch`` issues half the reduce-scatters (counted by
``moeshard.train.observe.comm_accounting``); with ``parallel.reshard_after_forward: false`` as well, the parameters
stay gathered between the micro-batches: one all-gather per unit per step, the same training again. Every token goes to every expert (top-k = all 8): with a discrete top-k choice
a rounding difference may move a token to another expert and the runs part by more than rounding.

In the EP 4 layout (the default overlapped dispatcher, which hands each expert weight's gradient over as the factors of
its three passes) the two runs also differ in ``train.expert_weight_grads``: ``every_micro_batch`` against
``last_micro_batch`` (each micro-batch's factors kept, every gradient formed once in the last backward), counted by
the factors the expert modules kept.
"""

from __future__ import annotations

import pytest

from moeshard.meshes.testing import run_distributed

WORLD, STEPS = 4, 3
LAYOUTS = {
    "ep2 x ep_fsdp2": ["--parallel.ep_size=2"],
    "ep4 x ep_fsdp1": [
        "--parallel.ep_size=4",
        "--parallel.allow_cross_node_ep=true",
    ],
}


def _train(layout: str, gradient_sync: str, *extra: str) -> dict:
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moeshard.data import DataConfig, StepBatches, open_dataset
    from moeshard.fsdp_moe import get_state_dict
    from moeshard.fsdp_moe._local_experts import LocalExperts
    from moeshard.train.config import load_config, resolve_model_config
    from moeshard.train.observe.comm_accounting import CommAccounting
    from moeshard.train.run import build, init_distributed, train_step

    device = init_distributed()
    cfg = load_config(
        None,
        [
            "--model.overrides.num_hidden_layers=2",
            "--model.overrides.num_experts_per_tok=8",
            *LAYOUTS[layout],
            "--data.seq_len=16",
            f"--train.global_batch_size={2 * WORLD}",  # micro-batch 1: two micro-batches per rank
            "--train.micro_batch_size=1",
            "--train.warmup_steps=0",
            "--train.lr=1e-3",
            f"--train.gradient_sync={gradient_sync}",
            f"--train.expert_weight_grads={gradient_sync}",
            *extra,
        ],
    )
    kept, take = [], LocalExperts.take

    def counting_take(self, weight, factors):  # the factors an expert module keeps (not those it forms at once)
        param = self._compute_param(weight)  # the optimizer defers by itself: ask for this backward
        deferring = param is not None and self._deferring_for(param)
        taken = take(self, weight, factors)
        kept.append(taken and deferring)
        return taken

    LocalExperts.take = counting_take
    job = build(cfg, device, resolve_model_config(cfg))
    rows = open_dataset(DataConfig(synthetic=True, seq_len=16, seed=3), vocab_size=job.model_config.vocab_size)
    batches = StepBatches(rows, global_batch=2 * WORLD, world_size=WORLD, micro_batch=1)
    m = job.meshes
    labels = {m.ep.get_group(): "ep", m.ep_fsdp.get_group(): "ep_fsdp", m.fsdp.get_group(): "fsdp"}
    losses, norms, reduce_scatters, gathers = [], [], [], []
    with CommAccounting(labels, int(os.environ["LOCAL_WORLD_SIZE"])) as accounting:
        for step in range(STEPS):
            accounting.reset()
            micro = batches.micro_batches(step, dist.get_rank())
            assert len(micro) == 2
            stats = train_step(job, micro).read()
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
            snapshot = accounting.snapshot()
            reduce_scatters.append({k: v["calls"] for k, v in snapshot.items() if k.startswith("reduce_scatter/")})
            gathers.append({k: v["calls"] for k, v in snapshot.items() if k.startswith("all_gather/")})
    sd = get_state_dict(job.model, job.optimizer)["model"]
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}
    LocalExperts.take = take
    out = {"losses": losses, "norms": norms, "reduce_scatters": reduce_scatters, "gathers": gathers}
    out["kept"] = sum(kept)
    out["ep_fsdp"] = m.ep_fsdp_size
    return {**out, "params": params} if dist.get_rank() == 0 else out


def _all() -> dict[str, tuple[dict, ...]]:
    runs = {layout: (_train(layout, "every_micro_batch"), _train(layout, "last_micro_batch")) for layout in LAYOUTS}
    no_reshard = "--parallel.reshard_after_forward=false"
    runs["gathered"] = (_train("ep2 x ep_fsdp2", "every_micro_batch", no_reshard),) + (
        _train("ep2 x ep_fsdp2", "last_micro_batch", no_reshard),
    )
    return runs


def test_last_micro_batch_sync_gives_the_same_training():
    results = run_distributed(_all, WORLD, ranks_per_node=2)[0]
    for layout, ep_fsdp in (("ep2 x ep_fsdp2", 2), ("ep4 x ep_fsdp1", 1)):
        every, last = results[layout]
        assert every["ep_fsdp"] == ep_fsdp
        assert last["losses"] == pytest.approx(every["losses"], rel=1e-5), layout
        assert last["norms"] == pytest.approx(every["norms"], rel=1e-5), layout
        for name, ref in every["params"].items():
            err = float((last["params"][name] - ref).norm() / ref.norm())
            assert err <= 1e-5, f"{layout}, {name}: relative error in norm {err:.2e}"
        # The option acts: each FSDP unit reduce-scatters once per step, not once per micro-batch (experts outside
        # FSDP reduce nothing either way).
        groups = {"reduce_scatter/fsdp"} | ({"reduce_scatter/ep_fsdp"} if ep_fsdp > 1 else set())
        for e, la in zip(every["reduce_scatters"], last["reduce_scatters"]):
            assert set(e) == set(la) == groups, layout
            assert all(e[k] == 2 * la[k] > 0 for k in groups), (layout, e, la)
        # the experts' weight gradients: kept at the first of each step's two micro-batches (2 layers x 2 weights x
        # the overlapped dispatcher's 3 passes)
        assert every["kept"] == 0 and last["kept"] == (STEPS * 2 * 2 * 3 if ep_fsdp == 1 else 0), layout
    # Kept gathered between the micro-batches: the same training as every micro-batch's reduce in the same layout,
    # and each unit gathers once per step instead of once per micro-batch (the step's all-gathers halve).
    every, gathered = results["gathered"]
    reference = results["ep2 x ep_fsdp2"][0]
    for run in (every, gathered):
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    for name, ref in reference["params"].items():
        err = float((gathered["params"][name] - ref).norm() / ref.norm())
        assert err <= 1e-5, f"kept gathered, {name}: relative error in norm {err:.2e}"
    for e, g in zip(every["gathers"], gathered["gathers"]):
        assert set(e) == set(g) and e, (e, g)
        assert all(e[k] == 2 * g[k] > 0 for k in e), (e, g)
