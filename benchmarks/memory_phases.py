"""Allocated GPU memory by phase of the training step, to set beside ``plan``'s estimate term by term.

A torchrun target that runs ``moeshard.train``'s CLI (``bench`` or ``train``) unchanged but for a record around
``train_step`` and each ``torch.autograd.backward``: the memory allocated at the step's start, after each
micro-batch's forward and after its backward, and the peak of each phase (the allocator's figures, read on the host:
no device sync). At exit it prints the last step's phases, in GiB:

    memphase: start alloc 61.20
    memphase: fwd0  alloc 70.11 peak 71.02
    memphase: bwd0  alloc 66.40 peak 80.33
    ...
    memphase: optimizer (clip, step) alloc 61.20 peak 63.90

    source benchmarks/gpu_env.sh
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/memory_phases.py bench \\
        --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=1 --steps 6 --warmup 2
"""

from __future__ import annotations

import atexit
import functools
import runpy
import sys

import torch

GiB = 2**30
_steps: list[list[tuple[str, float, float]]] = []


def _mark(name: str) -> None:
    if not torch.cuda.is_available():  # (on CPU the phases are named, with no figures)
        _steps[-1].append((name, 0.0, 0.0))
        return
    alloc, peak = torch.cuda.memory_allocated() / GiB, torch.cuda.max_memory_allocated() / GiB
    _steps[-1].append((name, alloc, peak))
    torch.cuda.reset_peak_memory_stats()


def _install() -> None:
    from moeshard.train import run

    train_step, backward = run.train_step, torch.autograd.backward

    @functools.wraps(train_step)
    def recorded_step(*args, **kwargs):
        _steps.append([])
        _mark("start")
        out = train_step(*args, **kwargs)
        _mark("optimizer (clip, step)")
        return out

    @functools.wraps(backward)
    def recorded_backward(*args, **kwargs):
        if _steps:
            _mark(f"fwd{sum(name.startswith('bwd') for name, *_ in _steps[-1])}")
        out = backward(*args, **kwargs)
        if _steps:
            _mark(f"bwd{sum(name.startswith('bwd') for name, *_ in _steps[-1])}")
        return out

    run.train_step, torch.autograd.backward = recorded_step, recorded_backward


def _report() -> None:
    if not _steps:
        return
    for name, alloc, peak in _steps[-1]:
        print(f"memphase: {name:<24s} alloc {alloc:7.2f}" + (f" peak {peak:7.2f}" if name != "start" else ""))


if __name__ == "__main__":
    _install()
    atexit.register(_report)
    sys.argv = ["moeshard.train", *sys.argv[1:]]
    runpy.run_module("moeshard.train", run_name="__main__", alter_sys=True)
