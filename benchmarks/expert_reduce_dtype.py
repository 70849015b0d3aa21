"""The experts' gradient reduce-scatter in bfloat16 against float32, on CPU: the same job twice, the losses compared.

    python benchmarks/expert_reduce_dtype.py                 # 100 steps per run; prints the figures of NOTES.md
    python benchmarks/expert_reduce_dtype.py --steps 20 --out /tmp/expert_reduce_dtype

The job: the embedded default (the tiny Qwen3-MoE: hidden 64, 8 experts top-2; AdamW at 3e-3, 16 rows per step)
with 2 layers, seq 32 and one micro-batch per rank, on 4 gloo processes as 2 nodes x 2 (``moeshard-train
launch-local``): EP 2 inside each node, the experts FSDP-sharded across the nodes (ep_fsdp 2), bfloat16 compute
(``parallel.param_dtype=bfloat16``), the same seed and data; once with ``parallel.expert_reduce_dtype=float32`` (the
default), once with ``bfloat16``, and, for scale, once with float32 compute (what bf16 compute itself changes).

Gloo sums bfloat16 in bfloat16, so the bf16 run rounds every expert gradient's sum over ep_fsdp (and its division
by the world size) to bfloat16 as a bf16 reduce-scatter on GPUs does; FSDP2 then casts it to the float32 gradient
of the float32 master weights. What it does to the speed (half the reduce-scatter bytes on the inter-node link) is
not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

JOB = [
    "--model.overrides.num_hidden_layers=2",
    "--data.seq_len=32",
    "--train.micro_batch_size=4",
    "--parallel.param_dtype=bfloat16",
    "--parallel.ep_size=2",
    "--eval.synthetic=false",
    "--checkpoint.save_final=false",
    "--checkpoint.resume=none",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=0",
]


RUNS = {  # name -> the keys that differ
    "fp32 reduce": ["--parallel.expert_reduce_dtype=float32"],
    "bf16 reduce": ["--parallel.expert_reduce_dtype=bfloat16"],
    "fp32 compute": ["--parallel.expert_reduce_dtype=float32", "--parallel.param_dtype=float32"],  # for scale
}


def run(name: str, steps: int, out: Path) -> list[dict]:
    """Train the job with the keys of ``RUNS[name]``; its step records (loss, grad_norm, ...)."""
    folder = out / name.replace(" ", "_")
    args = [*JOB, *RUNS[name], f"--train.steps={steps}", f"--logging.output_dir={folder}"]
    command = [sys.executable, "-m", "moeshard.train", "launch-local", "--nnodes", "2", "--nproc-per-node", "2"]
    res = subprocess.run(
        [*command, "--", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if res.returncode != 0:
        sys.exit(f"the {name} run failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), name
    return records


def compare(a: list[dict], b: list[dict]) -> list[str]:
    """How far run ``b``'s losses and gradient norms are from run ``a``'s."""
    loss_a, loss_b = [r["loss"] for r in a], [r["loss"] for r in b]
    diff = [abs(x - y) for x, y in zip(loss_a, loss_b)]
    first = next((step for step, d in enumerate(diff, 1) if d > 0), None)
    norm_rel = [abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] for x, y in zip(a, b)]
    tail = min(10, len(a))
    mean_a, mean_b = sum(loss_a[-tail:]) / tail, sum(loss_b[-tail:]) / tail
    return [
        f"loss at step 1: {loss_a[0]:.6f} / {loss_b[0]:.6f}; first step whose loss differs: {first}",
        f"per-step |loss difference|: max {max(diff):.2e} (step {diff.index(max(diff)) + 1}), mean "
        f"{sum(diff) / len(diff):.2e}; relative to the loss at most {max(d / x for d, x in zip(diff, loss_a)):.2e}",
        f"final loss {loss_a[-1]:.6f} / {loss_b[-1]:.6f}: relative difference "
        f"{abs(loss_b[-1] - loss_a[-1]) / loss_a[-1]:.2e}",
        f"mean loss of the last {tail} steps {mean_a:.6f} / {mean_b:.6f}: relative difference "
        f"{abs(mean_b - mean_a) / mean_a:.2e}",
        f"gradient norm, relative difference: step 1 {norm_rel[0]:.2e}, at most {max(norm_rel):.2e}",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("outputs/expert_reduce_dtype"), help="the runs' output folders")
    args = p.parse_args()
    start = time.perf_counter()
    runs = {name: run(name, args.steps, args.out) for name in RUNS}
    print(
        f"{args.steps} steps, EP 2 x ep_fsdp 2 (2 nodes x 2 gloo ranks), {time.perf_counter() - start:.0f} s for "
        f"{len(runs)} runs"
    )
    for a, b, what in (
        ("fp32 reduce", "bf16 reduce", "bf16 compute: the experts' reduce-scatter in bfloat16 against float32"),
        ("fp32 compute", "fp32 reduce", "for scale: bf16 compute against float32 compute (float32 reduce-scatter)"),
    ):
        print(what)
        print("\n".join(f"  {line}" for line in compare(runs[a], runs[b])))


if __name__ == "__main__":
    main()
