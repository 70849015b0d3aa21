"""Command line of the training job.

torchrun [torchrun args] -m moeshard.train --config FILE.yaml [--section.key=value ...]    # train
moeshard-train plan --config FILE.yaml --nnodes N --nproc-per-node G [--rank R]           # dry run, no GPU
moeshard-train export-hf --checkpoint DIR --out DIR                                        # Hub layout
moeshard-train launch-local --nnodes 2 --nproc-per-node 2 -- --config FILE.yaml            # nodes on localhost
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
import warnings

from moeshard.train.config import ConfigError, load_config

# Messages of gloo / NCCL / c10d when a peer process is gone.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted", "Broken pipe")
COMMANDS = ("train", "plan", "export-hf", "launch-local", "bench")


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeshard-train", description="Train (run under torchrun).")
    parser.add_argument("--config", default=None, help="YAML file; omitted: the embedded default job")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    import torch.distributed as dist

    from moeshard.train.job import run_job

    # Known and harmless here: DTensor's note on CPU random ops (initialisation).
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    run_job(cfg)
    # The job (model, dispatchers, optimizer, hooks: some hold process groups, some in reference cycles) goes now,
    # while the groups exist, not at interpreter exit after them.
    gc.collect()
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

    print(
        plan(
            cfg,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            rank=args.rank,
            micro_batch_size=args.micro_batch_size,
        )
    )
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


def _report(message: str, *, every_rank: bool) -> None:
    """One line on stderr: from rank 0 only for errors every rank raises alike, else from each failing rank."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _record_for_torchrun(message)
    if rank == 0 or every_rank:
        where = f" (rank {rank})" if every_rank and world > 1 else ""
        print(f"moeshard-train: error{where}: {message}", file=sys.stderr, flush=True)


def _record_for_torchrun(message: str) -> None:
    """Write the message where torchrun looks for a worker's error, so its failure summary shows it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        import json
        import time

        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)


def _close_process_group() -> None:
    # Without a barrier (a peer may be gone): enough for a clean exit of the failing process.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moeshard-train`` and ``python -m moeshard.train``.

    Returns the exit status: 0, 2 for a config error, 1 for any other error. Errors every rank raises alike
    (config, data, model, checkpoint, divergence) print one line from rank 0 and no traceback; unexpected ones
    print one line from each failing rank, plus the traceback with ``MOESHARD_TRACEBACK=1``.
    """
    from moeshard.train.errors import JobError

    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    handler = {"train": _train, "plan": _plan, "export-hf": _export, "launch-local": _launch_local, "bench": _bench}
    debug = os.environ.get("MOESHARD_TRACEBACK") == "1"
    try:
        return handler[command](argv)
    except ConfigError as e:
        _report(f"config: {e}", every_rank=False)
        code = 2
    except (JobError, ValueError, FileNotFoundError) as e:  # ValueError/FileNotFoundError: plan and export-hf
        _report(str(e), every_rank=not isinstance(e, JobError))
        code = 1
    except KeyboardInterrupt:
        _report("interrupted", every_rank=False)
        code = 130
    except Exception as e:  # noqa: BLE001 - one line per failing rank instead of a wall of tracebacks
        first = f"{type(e).__name__}: {e}".splitlines()[0]
        lost_peer = any(m in str(e) for m in _PEER_LOST)
        if lost_peer:
            first = f"lost contact with another rank (it failed or was killed; see its message) [{first[:160]}]"
        _report(first, every_rank=True)
        code = 1
        debug = debug or not lost_peer  # anything but a lost peer is unexpected: keep its traceback
    if debug:
        traceback.print_exc()
    _close_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
