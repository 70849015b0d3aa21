"""The step loop (``moeshard.train.run.run``) and its callbacks, on two gloo ranks (EP 2, a tiny model).

The hooks run in list order at fixed points of each step; ``start_step`` skips the steps a resumed run has taken
and the loop takes one ``(step, micro_batches)`` per step from its iterable (a ``moeshard.data.PrefetchLoader`` in
the job); an exception raised before the update leaves every parameter as the previous step left it, and
``on_run_end`` still runs.
"""

from __future__ import annotations

import torch

from moeshard.meshes.testing import run_distributed

JOB = [
    "--model.overrides.num_hidden_layers=2",
    "--parallel.ep_size=2",
    "--data.seq_len=16",
    "--train.steps=3",
    "--train.global_batch_size=4",
    "--train.micro_batch_size=1",
]


def _local_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _body() -> dict:
    import torch.distributed as dist

    from moeshard.data import DataConfig, StepBatches, open_dataset
    from moeshard.train.config import check_layout, load_config
    from moeshard.train.run import Callback, LossLog, build, init_distributed, run

    device = init_distributed()
    cfg = load_config(None, JOB)
    job = build(cfg, device, check_layout(cfg, world_size=2, ranks_per_node=2).model_config)
    rows = open_dataset(DataConfig(synthetic=True, seq_len=16), vocab_size=job.model_config.vocab_size)
    step_batches = StepBatches(rows, global_batch=4, world_size=2, micro_batch=1)
    asked: list[int] = []

    def batches(start: int):
        for step in range(start, 4):
            asked.append(step)  # taken when the loop asks for it
            yield step, step_batches.micro_batches(step, dist.get_rank())

    class Recorder(Callback):
        def __init__(self, name: str, events: list, stop_before_update_of: int = 0) -> None:
            self.name, self.events, self.stop = name, events, stop_before_update_of
            self.params: dict[int, dict[str, torch.Tensor]] = {}

        def on_run_start(self) -> None:
            self.events.append((self.name, "run_start"))

        def on_step_start(self, step: int) -> None:
            self.events.append((self.name, "step_start", step))

        def before_update(self, step: int, stats) -> None:
            self.events.append((self.name, "before_update", step))
            if step == self.stop:
                raise RuntimeError(f"stop before the update of step {step}")

        def on_step_end(self, step: int, stats) -> None:
            self.events.append((self.name, "step_end", step))
            self.params[step] = _local_params(job.model)

        def on_run_end(self) -> None:
            self.events.append((self.name, "run_end"))

    events: list = []
    log = LossLog()
    last = run(job, batches(1), [Recorder("a", events), Recorder("b", events), log], start_step=1)
    resumed = {
        "events": events,
        "asked": list(asked),
        "steps": len(log.losses),
        "losses": log.losses,
        "last_is_final": last is not None and last.read().loss == log.losses[-1],
    }

    events = []
    stopper = Recorder("s", events, stop_before_update_of=3)
    job.cfg = load_config(None, [*JOB, "--train.steps=4"])
    try:
        run(job, batches(1), [stopper], start_step=1)
        error = None
    except RuntimeError as e:
        error = str(e)
    unchanged = all(torch.equal(v, stopper.params[2][n]) for n, v in _local_params(job.model).items())
    return {**resumed, "error": error, "stop_events": events, "unchanged": unchanged}


def test_hooks_order_resume_and_stop_before_update():
    out = run_distributed(_body, 2)[0]
    per_step = [
        (name, hook, step) for step in (2, 3) for hook in ("step_start", "before_update", "step_end") for name in "ab"
    ]
    assert out["events"] == [("a", "run_start"), ("b", "run_start"), *per_step, ("a", "run_end"), ("b", "run_end")]
    assert out["asked"] == [1, 2] and out["steps"] == 2  # steps 2 and 3 (0-based 1 and 2) after 1 taken
    assert all(0 < x < 20 for x in out["losses"]) and out["last_is_final"]
    assert out["error"] == "stop before the update of step 3"
    assert out["stop_events"][-2:] == [("s", "before_update", 3), ("s", "run_end")]
    assert out["unchanged"]  # the parameters as step 2 left them
