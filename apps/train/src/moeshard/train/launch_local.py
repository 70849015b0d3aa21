"""Run N torchrun "nodes" on this machine (each with its own LOCAL_WORLD_SIZE), e.g. 2 nodes x 2 CPU processes.

    moeshard-train launch-local --nnodes 2 --nproc-per-node 2 -- --config apps/train/configs/default.yaml

Each node is a real ``torchrun --nnodes N --node-rank i`` agent with static rendezvous on 127.0.0.1, so the
job sees exactly what it sees on a cluster. ``--max-restarts`` is passed through (fault-tolerance tests).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys


def main(argv: list[str]) -> int:
    """Start the node agents and wait; the exit code is the first non-zero one."""
    parser = argparse.ArgumentParser(prog="moeshard-train launch-local")
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="arguments after -- go to the job")
    args = parser.parse_args(argv)
    job_args = args.job_args[1:] if args.job_args[:1] == ["--"] else args.job_args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={args.nnodes}", f"--node-rank={i}", f"--nproc-per-node={args.nproc_per_node}",
                "--master-addr=127.0.0.1", f"--master-port={port}", f"--max-restarts={args.max_restarts}",
                "-m", "moeshard.train", *job_args,
            ]
        )
        for i in range(args.nnodes)
    ]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)
