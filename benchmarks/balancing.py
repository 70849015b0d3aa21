"""Expert balancing on CPU: a tiny Qwen3-MoE whose routers start skewed, trained with each balancing method.

    python benchmarks/balancing.py                    # 100 steps per method; writes benchmarks/balancing.{svg,json}
    python benchmarks/balancing.py --steps 30 --out /tmp/balancing

The model: the ``tiny`` preset with 2 layers (8 experts, top-2), randomly initialised, then every router's rows of
experts 0 and 1 get a shared direction of the hidden states (the mean hidden state entering that layer's MoE block,
measured on the training data), so that from the first step nearly every token picks experts 0 and 1: max/mean
expert load ~4, the worst top-2 of 8 can be. It is saved as a Hub folder and trained with ``moeshard-train``
(one process, ``model.path``) for ``--steps`` steps, 4 micro-batches per step, on the default job's synthetic data,
once per method:

- ``none``: no balancing (``train.aux_loss.coef=0``);
- ``aux micro_batch``: the load-balancing loss per micro-batch (transformers' loss), coefficient 0.01;
- ``aux global_batch``: the same coefficient with the expert frequencies of the step's micro-batches so far;
- ``router_bias``: aux-loss-free balancing (``train.router_bias.update_rate=0.01``), no loss.

The figure is max/mean expert load (mean over layers) per step, read from each run's metrics.jsonl (the step's
global counts, ``logging.expert_load_every=1``). ``apps/train/tests/test_balancing.py`` runs the same with fewer
steps and asserts that every method ends lower than no balancing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

METHODS: dict[str, list[str]] = {
    "none": ["--train.aux_loss.coef=0"],
    "aux micro_batch": ["--train.aux_loss.coef=0.01", "--train.aux_loss.scope=micro_batch"],
    "aux global_batch": ["--train.aux_loss.coef=0.01", "--train.aux_loss.scope=global_batch"],
    "router_bias": ["--train.aux_loss.coef=0", "--train.router_bias.update_rate=0.01"],
}
JOB = [
    "--parallel.ep_size=1",
    "--data.seq_len=32",
    "--train.global_batch_size=16",
    "--train.micro_batch_size=4",
    "--train.warmup_steps=0",
    "--train.schedule=constant",
    "--eval.synthetic=false",
    "--checkpoint.save_final=false",
    "--checkpoint.resume=none",
    "--logging.tensorboard=false",
    "--logging.progress_bar=false",
    "--logging.expert_load_every=1",
]
COLORS = {"none": "#d62728", "aux micro_batch": "#1f77b4", "aux global_batch": "#2ca02c", "router_bias": "#9467bd"}


def skewed_model(path: Path, seq_len: int = 32, layers: int = 2) -> Path:
    """A tiny random Qwen3-MoE Hub folder whose routers send nearly every token to experts 0 and 1."""
    from moeshard.data import DataConfig, open_dataset
    from moeshard.models.common import routers
    from moeshard.models.qwen3moe import Qwen3MoeForCausalLM, get_preset_config

    config = get_preset_config("tiny", num_hidden_layers=layers)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    model.init_weights()
    rows = open_dataset(DataConfig(synthetic=True, seq_len=seq_len), vocab_size=config.vocab_size)
    ids = torch.stack([torch.from_numpy(r.input_ids) for r in rows.rows(list(range(64)))[0]])
    inputs: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, args, out: inputs.append(args[0].detach())) for r in routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for router, x_TD in zip(routers(model), inputs):
            direction = x_TD.mean(0) / x_TD.mean(0).norm()  # what the tokens entering this layer's MoE share
            scale = 4.0 / float((x_TD @ direction).mean())  # ~4 logits more for experts 0 and 1, on average
            router.weight[:2] += scale * direction
    model.save_pretrained(path)
    return path


def run_method(name: str, model: Path, out: Path, steps: int) -> list[float]:
    """Train ``model`` with balancing method ``name`` for ``steps`` steps; max/mean expert load per step (mean over
    layers), from the run's metrics.jsonl."""
    from moeshard.train.config import load_config
    from moeshard.train.job import run_job

    folder = out / name.replace(" ", "_")
    args = [*JOB, *METHODS[name], f"--model.path={model}", f"--train.steps={steps}", f"--logging.output_dir={folder}"]
    run_job(load_config(None, args))
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    per_layer = [r["expert_load"]["max_over_mean"] for r in records if "expert_load" in r]
    return [sum(layers.values()) / len(layers) for layers in per_layer]


def demo(out: Path, steps: int = 100) -> dict[str, list[float]]:
    """Every method on the same skewed model: ``{method: [max/mean load per step]}``."""
    out.mkdir(parents=True, exist_ok=True)
    model = skewed_model(out / "skewed_model")
    return {name: run_method(name, model, out, steps) for name in METHODS}


def write_svg(curves: dict[str, list[float]], path: Path, width: int = 640, height: int = 320) -> None:
    """A line chart of the curves (no plotting library needed)."""
    left, right, top, bottom = 56, 150, 20, 40
    steps = max(len(c) for c in curves.values())
    top_value = max(4.0, max(max(c) for c in curves.values()))

    def xy(i: int, v: float) -> str:
        x = left + (width - left - right) * i / max(1, steps - 1)
        y = top + (height - top - bottom) * (1 - (v - 1) / (top_value - 1))
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for v in range(1, int(top_value) + 1):  # horizontal grid lines at 1, 2, 3, 4
        y = xy(0, v).split(",")[1]
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y}" y2="{y}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 8}" y="{float(y) + 4:.1f}" text-anchor="end">{v}</text>')
    base = height - bottom
    for i in range(0, steps, max(1, steps // 5)):
        x = xy(i, 1).split(",")[0]
        parts.append(f'<text x="{x}" y="{base + 16}" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    parts.append(
        f'<text x="14" y="{(top + base) / 2}" text-anchor="middle" transform="rotate(-90 14 {(top + base) / 2})">'
        "max / mean expert load</text>"
    )
    for k, (name, curve) in enumerate(curves.items()):
        color = COLORS.get(name, "black")
        points = " ".join(xy(i, v) for i, v in enumerate(curve))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{points}"/>')
        y = top + 16 * k + 8
        parts.append(
            f'<line x1="{width - right + 10}" x2="{width - right + 30}" y1="{y}" y2="{y}" stroke="{color}" '
            'stroke-width="2"/>'
        )
        parts.append(f'<text x="{width - right + 36}" y="{y + 4}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("outputs/balancing"), help="the runs' output folders")
    p.add_argument("--figure", type=Path, default=Path(__file__).with_name("balancing.svg"))
    args = p.parse_args()
    curves = demo(args.out, args.steps)
    write_svg(curves, args.figure)
    summary = {name: {"first": c[0], "last_10_mean": sum(c[-10:]) / len(c[-10:])} for name, c in curves.items()}
    args.figure.with_suffix(".json").write_text(json.dumps({"steps": args.steps, "max_over_mean": summary}, indent=1))
    for name, s in summary.items():
        print(f"{name:18s} max/mean load: step 1 {s['first']:.2f}, mean of the last 10 steps {s['last_10_mean']:.2f}")
    print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
