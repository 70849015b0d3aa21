"""The training step with each decoder layer's compiled attention half replayed as a CUDA graph.

A torchrun target that runs ``moeshard.train``'s CLI (``bench`` or ``train``) with ``parallelize``'s compile step
changed in one place: ``layer.attention_half`` is compiled with ``mode=CG_MODE`` (default ``"reduce-overhead"``:
Inductor's CUDA graph trees, one recorded graph per layer and direction, replayed with one launch each) instead of
the default mode. Everything else (the eager MoE half, FSDP2's hooks, the head's loss kernel) is unchanged, so the
difference to a plain ``bench`` is what the attention half's ~45 launches per layer and micro-batch cost the host.

    source benchmarks/gpu_env.sh
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/cudagraph_probe.py bench \\
        --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=1 --steps 12 --warmup 4

At exit it prints Inductor's CUDA graph counters: the graphs skipped, and the non-static inputs summed over every
recording (a count that keeps growing with the steps means the trees record again each step: parameters at a new
address).

FSDP2 gathers each unit's parameters into new storage every step, and the trees take parameters as static inputs
(their addresses recorded in the graph): a new address re-records the graph. ``CG_NONSTATIC_PARAMS=1`` makes Dynamo
leave parameters unmarked (its ``mark_static_input`` a no-op, a probe only), so the trees copy them into the
recorded graph's own input buffers at each replay instead: what the step would gain if the attention half took its
weights as plain inputs.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

import torch


def _install() -> None:
    from moeshard.models.common import _parallelize

    original = _parallelize._compile
    mode = os.environ.get("CG_MODE", "reduce-overhead")

    def compile_with_graphs(model, kernels):
        original(model, kernels)
        for layer in model.model.layers:
            layer.attention_half = torch.compile(type(layer).attention_half.__get__(layer), mode=mode)

    _parallelize._compile = compile_with_graphs
    if os.environ.get("CG_NONSTATIC_PARAMS"):
        from torch._dynamo.variables import builder

        builder.VariableBuilder.mark_static_input = lambda self, value, guard: None


def _report() -> None:
    from torch._dynamo.utils import counters

    print(f"cudagraph_probe: mode={os.environ.get('CG_MODE', 'reduce-overhead')} inductor counters:")
    for key, value in sorted(counters.get("inductor", {}).items()):
        if "cudagraph" in key:
            print(f"  {key}: {value}")


if __name__ == "__main__":
    _install()
    atexit.register(_report)
    sys.argv = ["moeshard.train", *sys.argv[1:]]
    runpy.run_module("moeshard.train", run_name="__main__", alter_sys=True)
