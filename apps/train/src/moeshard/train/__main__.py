"""Command line of the training job.

    torchrun [torchrun args] -m moeshard.train --config FILE.yaml [--section.key=value ...]    # train
    moeshard-train plan --config FILE.yaml --nnodes N --nproc-per-node G [--rank R]           # dry run, no GPU
    moeshard-train export-hf --checkpoint DIR --out DIR                                        # Hub layout
    moeshard-train launch-local --nnodes 2 --nproc-per-node 2 -- --config FILE.yaml            # nodes on localhost
"""

from __future__ import annotations

import argparse
import sys

from moeshard.train.config import ConfigError, load_config

COMMANDS = ("train", "plan", "export-hf", "launch-local", "bench")


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeshard-train", description="Train (run under torchrun).")
    parser.add_argument("--config", default=None, help="YAML file; omitted: the embedded default job")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    from moeshard.train.trainer import run

    run(cfg)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeshard-train plan", description="Dry run on the fake backend.")
    parser.add_argument("--config", default=None)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="for the activation estimate")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    from moeshard.train.plan import plan

    print(plan(cfg, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, rank=args.rank, micro_batch_size=args.micro_batch_size))
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeshard-train export-hf", description="Checkpoint → Hub layout.")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder (step_XXXXXXXX)")
    parser.add_argument("--out", required=True, help="new folder for config.json + safetensors (+ tokenizer)")
    args = parser.parse_args(argv)
    from moeshard.train.export import export_hf

    path = export_hf(args.checkpoint, args.out)
    print(f"wrote {path}")
    return 0


def _launch_local(argv: list[str]) -> int:
    from moeshard.train.launch_local import main as launch_main

    return launch_main(argv)


def _bench(argv: list[str]) -> int:
    from moeshard.train.bench import main as bench_main

    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moeshard-train`` and ``python -m moeshard.train``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    handler = {"train": _train, "plan": _plan, "export-hf": _export, "launch-local": _launch_local, "bench": _bench}
    try:
        return handler[command](argv)
    except ConfigError as e:
        print(f"moeshard-train: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
