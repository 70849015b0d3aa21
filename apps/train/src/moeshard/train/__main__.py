"""Command line of the training job (``moeshard-train --help`` lists the commands).

torchrun [torchrun args] -m moeshard.train --config FILE.yaml [--section.key=value ...]    # train
moeshard-train config --show [--config FILE.yaml] [--section.key=value ...]               # every key explained
moeshard-train plan --config FILE.yaml --nnodes N --nproc-per-node G [--rank R] [--summary]  # dry run, no GPU
moeshard-train export-hf --checkpoint DIR --out DIR                                        # Hub layout
moeshard-train launch-local --nnodes 2 --nproc-per-node 2 -- --config FILE.yaml            # nodes on localhost
moeshard-train prepare-data --input 'corpus/*.jsonl' --tokenizer DIR --output DIR          # tokenise once
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import hashlib
import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch.distributed as dist
import yaml

from moeshard.checkpoint import CheckpointError, describe_failure
from moeshard.data import DataError, ExitStatus, prepare_command, print_error
from moeshard.train._torch_internals import default_store
from moeshard.train.cluster.launch_local import main as launch_main
from moeshard.train.cluster.preemption import EXIT_STATUS
from moeshard.train.commands.bench import main as bench_main
from moeshard.train.commands.plan import plan
from moeshard.train.config import GROUP_OFF, ConfigError, JobConfig, config_table, describe_keys, load_config
from moeshard.train.errors import ArgumentParser, JobError, exit_status
from moeshard.train.export import export_hf
from moeshard.train.job import run_job

PROG = "moeshard-train"  # the prefix of every error line: `moeshard-train: error: ...`
ALIKE_WAIT_S = 30.0  # how long a rank waits for rank 0 to report an error every rank raised alike
# Messages of gloo / NCCL / c10d when a peer process is gone.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted", "Broken pipe")
# Each command and its one line in `moeshard-train --help`.
COMMANDS = {
    "train": "train (the default command; run it under torchrun): --config FILE.yaml [--section.key=value ...]",
    "config": "the resolved configuration as YAML; --show: every key with its value, default and meaning",
    "plan": "dry run for any cluster, no GPU: meshes, parameter shards, memory and communication per rank",
    "export-hf": "a checkpoint -> a Hub folder (config.json, safetensors, tokenizer) that transformers loads",
    "launch-local": "N torchrun agents on this machine, as N nodes would run the job",
    "bench": "time training steps of the 30B geometry with L layers (under torchrun); checkpoint cost",
    "prepare-data": "tokenise a corpus once, on all cores, into the flat token format",
}
USAGE = """usage: moeshard-train [COMMAND] [options]        (no command: train)
       torchrun [torchrun options] -m moeshard.train [COMMAND] [options]

commands:
{commands}

`moeshard-train COMMAND --help` lists a command's options; `moeshard-train config --show` every config key.
Errors are one line, `moeshard-train: error: ...`. Exit status: 0 done; 2 a user's error (a flag, config key,
file, data, model, layout or checkpoint the job cannot use: the line says the fix, nothing was overwritten);
1 a failure at run time or an unexpected one (diverged loss, failed save, lost peer, a bug:
MOESHARD_TRACEBACK=1 shows its traceback); 75 stopped by SIGTERM / SIGUSR1 after saving (run it again);
130 interrupted (Ctrl-C). Under torchrun the workers exit so and torchrun itself exits 1."""


def _help() -> str:
    return USAGE.format(commands="\n".join(f"  {name:14s}{line}" for name, line in COMMANDS.items()))


def _keys_help() -> str:
    """Every config key with its default and meaning (the fields' own, as ``config --show`` prints them)."""
    rows = [f"  --{key}={_show(default)}\n      {meaning}" for key, _, default, meaning in describe_keys(JobConfig())]
    return (
        "Overrides: --section.key=value, e.g. --train.lr=1e-4 (`config --show`: the same keys, resolved):\n"
        + "\n".join(rows)
    )


def _train(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="moeshard-train",
        description="Train (run under torchrun). `moeshard-train --help` lists the other commands.",
        epilog=_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML file; omitted: the embedded default job")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    # Known and harmless here: DTensor's note on CPU random ops (initialisation).
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    stopped = run_job(cfg)["stopped"] is not None  # a signal stopped it after saving a step (preemption)
    # The job (model, dispatchers, optimizer, hooks: some hold process groups, some in reference cycles) goes now,
    # while the groups exist, not at interpreter exit after them.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return EXIT_STATUS if stopped else 0


def _config(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="moeshard-train config",
        description="The job's configuration (the YAML file, if any, with the overrides applied), as YAML.",
        epilog="Overrides: --section.key=value, e.g. --train.lr=1e-4 --logging.wandb.project=x",
    )
    parser.add_argument("--config", default=None, help="YAML file; omitted: the embedded default job")
    parser.add_argument("--show", action="store_true", help="every key with its value, default and meaning")
    parser.add_argument(
        "--markdown", action="store_true", help="every key's default and meaning as a Markdown table (the README's)"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    if args.markdown:
        print(config_table(cfg), end="")
        return 0
    if not args.show:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    rows = [(key, _show(v), _show(d), meaning) for key, v, d, meaning in describe_keys(cfg)]
    wk = max(len(r[0]) for r in rows)
    wv = min(24, max(len(r[1]) for r in rows))
    wd = min(18, max(len(r[2]) for r in rows))
    print(f"{'key':{wk}s}  {'value':{wv}s}  {'default':{wd}s}  meaning")
    for key, v, d, meaning in rows:
        mark = "*" if v not in (d, GROUP_OFF) else " "  # changed by the file or the command line
        print(f"{key:{wk}s} {mark}{v:{wv}s}  {d:{wd}s}  {meaning}")
    return 0


def _show(value: object) -> str:
    """A value as YAML writes it in flow style (``null``, ``true``, ``[0.9, 0.95]``); floats short."""
    if isinstance(value, float):
        short = f"{value:.6g}"
        return short if any(c in short for c in ".einf") else f"{short}.0"
    if isinstance(value, str):
        return value
    if hasattr(value, "__dataclass_fields__"):
        return "{...}"  # a group of keys, shown on the rows below
    if isinstance(value, tuple) and value and hasattr(value[0], "__dataclass_fields__"):
        value = [dataclasses.asdict(v) for v in value]
    return json.dumps(value, default=str).replace('"', "")


def _plan(argv: list[str]) -> int:
    parser = ArgumentParser(prog="moeshard-train plan", description="Dry run on the fake backend.")
    parser.add_argument("--config", default=None)
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="for the activation estimate")
    parser.add_argument("--summary", action="store_true", help="the totals, without the table of parameters")
    parser.add_argument(
        "--gpu-memory", type=float, default=None, help="GiB per GPU to check the estimate against (default: this GPU's)"
    )
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    print(
        plan(
            cfg,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            rank=args.rank,
            micro_batch_size=args.micro_batch_size,
            table=not args.summary,
            gpu_memory_gib=args.gpu_memory,
        )
    )
    return 0


def _export(argv: list[str]) -> int:
    parser = ArgumentParser(prog="moeshard-train export-hf", description="Checkpoint → Hub layout.")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint folder (step_XXXXXXXX)")
    parser.add_argument("--out", required=True, help="new folder for config.json + safetensors (+ tokenizer)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "keep"), help="of the weights"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file, e.g. 5GB, 500MB")
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's checkpoint: the base model (the run's model.path) with the adapters merged; without "
        "it such a checkpoint gives its adapter in PEFT's format",
    )
    args = parser.parse_args(argv)
    path = export_hf(
        args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, merge_lora=args.merge_lora
    )
    print(f"wrote {path}")
    return 0


def _launch_local(argv: list[str]) -> int:
    return launch_main(argv)


def _prepare_data(argv: list[str]) -> int:
    # moeshard.data's prepare, under the job's name; its DataError is reported below like every user error.
    return prepare_command(argv, prog=f"{PROG} prepare-data")


def _bench(argv: list[str]) -> int:
    return bench_main(argv)


def _report(message: str, *, alike: bool) -> None:
    """One line on stderr for a failure.

    Args:
        alike: every rank raises this error identically (computed from the same inputs or agreed through a
            collective): rank 0 prints it and the other ranks wait, silent, until it has (torchrun stops them once
            a worker exits: had they exited first, rank 0 could be stopped before its line). Otherwise the first
            rank to report this message prints it, with its rank (the job's c10d store counts who reported what;
            without a reachable store each failing rank prints).
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _record_for_torchrun(message)
    store = _job_store()
    _store_add(store, "errors/any", 1)  # ranks that merely lose contact with this one stay silent
    if alike:
        if rank == 0:
            print_error(PROG, message)
            _store_add(store, "errors/said", 1)
        elif world > 1 and not _wait_for_rank0(store):
            print_error(PROG, message, where=f" (rank {rank}; rank 0 did not report it)")
        return
    key = "errors/" + hashlib.sha1(message.encode()).hexdigest()[:16]
    if _store_add(store, key, 1) in (None, 1):
        print_error(PROG, message, where=f" (rank {rank})" if world > 1 else "")


def _wait_for_rank0(store: object | None) -> bool:
    """Wait (at most ``ALIKE_WAIT_S``) for rank 0 to print an error every rank raised alike. True: it did, or there
    is no store to ask (then the wait is all: torchrun stops this process as soon as rank 0 exits)."""
    if store is None:
        time.sleep(ALIKE_WAIT_S)
        return True
    try:
        store.wait([_store_key("errors/said")], timedelta(seconds=ALIKE_WAIT_S))  # type: ignore[attr-defined]
        return True
    except Exception:  # noqa: BLE001 - timed out, or the store's host is gone
        return False


def _report_lost_peer(detail: str) -> None:
    """A rank whose collective failed because a peer is gone: silent when a rank already reported a cause (that
    rank's line and torchrun's summary name it), else one line for the job (a peer killed without a word)."""
    message = f"lost contact with another rank (it failed or was killed; see its message) [{detail[:160]}]"
    _record_for_torchrun(message)
    store = _job_store()
    reported = _store_add(store, "errors/any", 0)
    if reported is not None and reported > 0:
        return
    if _store_add(store, "errors/lost", 1) in (None, 1):
        print_error(PROG, message, where=f" (rank {int(os.environ.get('RANK', '0'))})")


def _job_store() -> object | None:
    """The c10d store every rank of this job reaches, or None: torchrun's agent store (there from the start, before
    the process group; ``TORCHELASTIC_USE_AGENT_STORE``), else the process group's."""
    try:
        wait = timedelta(seconds=10)  # never wait long on a store whose host is gone
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
            host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
            return dist.TCPStore(host, port, is_master=False, timeout=wait, wait_for_workers=False)
        if not dist.is_initialized():
            return None
        store = default_store()
        store.set_timeout(wait)
        return store
    except Exception:  # noqa: BLE001 - no store: the caller prints
        return None


def _store_key(name: str) -> str:
    # The agent's store outlives a restart of the workers: each attempt counts afresh.
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"moeshard/{attempt}/{name}"


def _store_add(store: object | None, name: str, amount: int) -> int | None:
    """Add to a counter in the job's store (shared by all ranks); its new value, or None without a store."""
    if store is None:
        return None
    try:
        return int(store.add(_store_key(name), amount))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the store's host is gone: the caller prints
        return None


def _one_line(error: BaseException) -> str:
    """``Type: first line``; for DCP's CheckpointException (a BaseException) each failed rank's error."""
    if type(error).__name__ == "CheckpointException":  # torch.distributed.checkpoint's, without importing it here
        return f"checkpoint read/write failed: {describe_failure(error)}"
    return f"{type(error).__name__}: {error}".splitlines()[0]


def _record_for_torchrun(message: str) -> None:
    """Write the message where torchrun looks for a worker's error, so its failure summary shows it.

    In torchelastic's structured layout (its ``ErrorHandler``'s), with the line in place of a traceback: the agent
    then copies it without warning about the format, and its summary shows the line under ``traceback :``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)


def _close_process_group() -> None:
    # Without a barrier (a peer may be gone): enough for a clean exit of the failing process.
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moeshard-train`` and ``python -m moeshard.train``.

    Returns the exit status (:class:`moeshard.data.ExitStatus`): 0; 2 for a user's error (a flag, config key, file,
    data, model, layout or checkpoint that cannot be used); 1 for a failure at run time (a diverged loss, a failed
    save, a lost peer) or an unexpected one; 75 when SIGTERM or SIGUSR1 stopped the training after saving a step
    (``moeshard.train.cluster.preemption``: run it again to continue); 130 on SIGINT.
    Every failure is one line: errors every rank raises alike (config, data, model, checkpoint, divergence) from
    rank 0, others from the first rank that reports them; a rank that only lost contact with a failed peer stays
    silent. ``MOESHARD_TRACEBACK=1`` adds the traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--help"], ["-h"], ["help"]):
        print(_help())
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        print_error(PROG, f"unknown command {argv[0]!r}; {hint}moeshard-train --help lists them")
        return ExitStatus.USER_ERROR
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    handler = {
        "train": _train,
        "config": _config,
        "plan": _plan,
        "export-hf": _export,
        "launch-local": _launch_local,
        "bench": _bench,
        "prepare-data": _prepare_data,
    }
    debug = os.environ.get("MOESHARD_TRACEBACK") == "1"
    error: BaseException | None = None
    try:
        return handler[command](argv)
    except ConfigError as e:
        error, code = e, ExitStatus.USER_ERROR
        _report(f"config: {e}", alike=True)
    except (JobError, CheckpointError) as e:  # the checkpoint package's errors say every_rank too
        error, code = e, exit_status(e)
        _report(str(e), alike=e.every_rank)
    except (DataError, ValueError, FileNotFoundError) as e:  # prepare-data, plan, export-hf, the commands' flags
        error, code = e, ExitStatus.USER_ERROR
        _report(str(e), alike=False)
    except KeyboardInterrupt as e:
        error, code = e, ExitStatus.INTERRUPTED
        _report("interrupted", alike=True)
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch.distributed raises BaseException subclasses too
        error, code = e, ExitStatus.FAILED
        first = _one_line(e)
        if any(m in str(e) for m in _PEER_LOST):
            _report_lost_peer(first)
        else:
            _report(f"{first} (unexpected; MOESHARD_TRACEBACK=1 shows the traceback)", alike=False)
    if debug:
        # Outside its except block only the saved exception still knows its traceback (print_exc() has none).
        traceback.print_exception(error)
    _close_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
