"""Run N torchrun "nodes" on this machine (each with its own LOCAL_WORLD_SIZE), e.g. 2 nodes x 2 CPU processes.

    moeshard-train launch-local --nnodes 2 --nproc-per-node 2 -- --config apps/train/configs/default.yaml
    moeshard-train launch-local --nnodes 2 --nproc-per-node 2 --max-restarts 2 -- --config ...

Each node is a real ``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d`` agent on 127.0.0.1, the
launch of a real cluster, so the job sees exactly what it sees there; with ``--max-restarts`` a failed rank makes
every agent restart its workers, which resume from the newest complete checkpoint. The agents run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): restarted workers then meet in a fresh store instead of
reading the previous attempt's rendezvous keys (with gloo on torch 2.13 they otherwise fail to connect).

The config and the layout are checked first, as training checks them before its first step
(``moeshard.train.config.check_layout``): a bad key or an EP size that does not divide the world is one line and
exit status 2 in seconds, and no worker starts.

SIGTERM or SIGUSR1 to this command goes to every agent, and each agent forwards it to its workers (they handle
SIGUSR1 too: ``--signals-to-handle``), which stop after a step with a checkpoint of it
(``moeshard.train.cluster.preemption``); the agents then exit with status 1 (torchrun's own status after a signal).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from moeshard.train.config import check_layout, load_config
from moeshard.train.errors import ArgumentParser

GRACE_S = 60.0  # after one agent fails, how long the others get to notice and stop
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's default and SLURM's early warning


def agent_command(nnodes: int, nproc_per_node: int, port: int, run_id: str, max_restarts: int) -> list[str]:
    """The torchrun command line of one local node agent."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=1",
        f"--signals-to-handle={SIGNALS_TO_HANDLE}",
        "-m",
        "moeshard.train",
    ]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to a bind of port 0 (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rendezvous_port(rng: random.Random | None = None) -> int:
    """A free port on 127.0.0.1 for the agents' store, below the kernel's ephemeral range (20480-32767 by default).

    The port is free when chosen and bound by an agent a moment later. A port from the ephemeral range could be
    handed in between to any process that binds port 0 (gloo's pair sockets, another torchrun's store): then no
    agent can host the store and all of them time out as clients (seen once in a run of the CI script: two 60 s
    waits, then a failed job). Below the range only a process that names its port can take it."""
    rng = rng or random.SystemRandom()
    top = min(_ephemeral_low(), 32768) - 1
    for _ in range(100):
        port = rng.randint(max(1024, top - 12287), max(1024, top))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_job(job_args: list[str], nnodes: int, nproc_per_node: int) -> None:
    """Refuse what every worker of the job would refuse before its first step (the config and the layout), here,
    before any worker starts. Commands other than training (``bench``, ...) check their own arguments.

    Raises:
        ConfigError: the job's one-line message (reported as a config error, exit status 2).
    """
    if job_args[:1] == ["train"]:
        job_args = job_args[1:]
    elif job_args and not job_args[0].startswith("-"):
        return
    if any(a in ("-h", "--help") for a in job_args):
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)  # training's own option (moeshard.train.__main__)
    args, overrides = parser.parse_known_args(job_args)
    cfg = load_config(args.config, overrides)
    check_layout(cfg, world_size=nnodes * nproc_per_node, ranks_per_node=nproc_per_node)


def main(argv: list[str]) -> int:
    """Start the node agents and wait; the exit code is the first non-zero one."""
    parser = ArgumentParser(prog="moeshard-train launch-local")
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun --max-restarts of every agent")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="arguments after -- go to the job")
    args = parser.parse_args(argv)
    job_args = args.job_args[1:] if args.job_args[:1] == ["--"] else args.job_args
    check_job(job_args, args.nnodes, args.nproc_per_node)
    port = rendezvous_port()
    env = {
        **os.environ,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
    }
    command = agent_command(args.nnodes, args.nproc_per_node, port, uuid.uuid4().hex[:12], args.max_restarts)
    procs = [subprocess.Popen([*command, *job_args], env=env) for _ in range(args.nnodes)]

    def forward(signum: int, frame: object) -> None:  # a preemption: every agent passes it on to its workers
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)
