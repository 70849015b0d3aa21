"""Host time per function and phase of the training step, without a profiler and without a sync.

A torchrun target that runs ``moeshard.train``'s CLI (``bench`` or ``train``) with a few functions of the step wrapped
in ``time.perf_counter`` pairs: the decoder layer, the MoE block, its router, the EP dispatcher and its expert pass,
FSDP2's pre-forward and post-backward of each unit and its root's end of backward, the autograd Functions'
backwards (the combine's backward is where a checkpointed layer's recompute runs) and ``torch.autograd.backward``.
Each call counts in the phase it ran in: ``fwd``, or ``bwd`` inside the autograd engine (backward, and full
checkpointing's recompute). Python's garbage collector is timed too (``gc.callbacks``).

At exit it prints, over the steps after the warm-up, the host milliseconds per step of ``train_step`` and of each
function and phase (inclusive: the dispatcher's time holds its expert pass's). Where the host is ahead of the
device, each figure is that code's own host cost; where the launch queue is full, a figure also holds the waits.

    source benchmarks/gpu_env.sh
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/host_phases.py bench \\
        --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=1 \\
        --parallel.activation_checkpointing=full --steps 10 --warmup 4

Environment: ``HOST_PHASES_SKIP`` steps left out first (default 4, bench's warm-up), ``HOST_PHASES_STEPS`` steps
counted (default 6); ``HOST_PHASES_CPP_WRAPPER=1`` compiles with Inductor's C++ wrapper
(``torch._inductor.config.cpp_wrapper``), ``HOST_PHASES_COMBO_KERNELS=1`` with Inductor's combo kernels (independent
kernels of a graph fused horizontally into fewer launches); ``HOST_PHASES_SKIP_GUARDS=N`` sets
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` from step N on; ``HOST_PHASES_CUDAGRAPHS=1`` compiles
the attention halves as CUDA graphs (``benchmarks/cudagraph_probe.py``, with its ``CG_*`` variables);
``HOST_PHASES_SAMPLE=1`` also samples every thread's Python stack each 0.5 ms over the counted steps
(``sys._current_frames``, the GIL's switch interval set to 0.5 ms) and prints, per thread, the functions by inclusive
and by self share of the samples: a function's self share holds the C++ it calls (aten ops, launches), which torch
runs with the GIL released.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import os
import runpy
import sys
import threading
import time

import torch

_acc: dict[tuple[str, str], float] = collections.defaultdict(float)
_sampling = {"on": False, "n": collections.Counter()}
_incl: dict[tuple[str, str], int] = collections.defaultdict(int)
_self: dict[tuple[str, str], int] = collections.defaultdict(int)


def _where(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{code.co_name}"


def _sampler() -> None:
    me = threading.get_ident()
    names = {}
    while True:
        time.sleep(0.0005)
        if not _sampling["on"]:
            continue
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            if tid not in names:
                names[tid] = "main" if tid == threading.main_thread().ident else f"thread {len(names)}"
            thread = names[tid]
            _sampling["n"][thread] += 1
            _self[(thread, _where(frame))] += 1
            seen = set()
            while frame is not None:
                w = _where(frame)
                if w not in seen:
                    seen.add(w)
                    _incl[(thread, w)] += 1
                frame = frame.f_back


_gc = {"s": 0.0, "t0": 0.0}


def _phase() -> str:
    return "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"


def _wrap(owner, name: str, label: str, static: bool = False) -> None:
    f = getattr(owner, name, None)
    if f is None:  # an older tree without this function
        return

    # Bound here, not looked up as globals while Dynamo traces: this script runs as ``__main__`` and runpy hands that
    # name to moeshard.train, so a traced global lookup of this module fails ("module '__main__' has no attribute").
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(f)
    def timed(*args, **kwargs):
        if is_compiling():  # traced into a compiled graph (the router): no timer, no graph break
            return f(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            _acc[(label, _phase())] += time.perf_counter() - t0

    setattr(owner, name, staticmethod(timed) if static else timed)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
    else:
        _gc["s"] += time.perf_counter() - _gc["t0"]


def _install() -> list[tuple[float, dict]]:
    from moeshard.ep import _mlp, _permute
    from moeshard.ep._dispatch import _base, local
    from moeshard.models.common import _causal_lm, _moe

    _wrap(_causal_lm.DecoderLayer, "forward", "decoder layer")
    _wrap(_moe.MoEBlock, "forward", "MoE block")
    _wrap(_moe.TopKRouter, "forward", "router (top-k)")
    _wrap(_moe.GroupLimitedRouter, "forward", "router (group-limited)")
    _wrap(_base.ExpertDispatch, "__call__", "EP dispatcher")
    _wrap(local.LocalDispatch, "run_experts", "expert pass (EP 1)")
    _wrap(_mlp._ExpertMLP, "backward", "expert MLP backward", static=True)
    _wrap(_permute._SumCopies, "backward", "combine backward (+ recompute)", static=True)
    _wrap(_permute._ExpandRows, "backward", "row expansion backward", static=True)
    _wrap(torch.autograd, "backward", "autograd.backward")
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

    _wrap(_fsdp_param_group.FSDPParamGroup, "pre_forward", "FSDP2 pre-forward (a unit)")
    _wrap(_fsdp_param_group.FSDPParamGroup, "post_backward", "FSDP2 post-backward (a unit)")
    _wrap(_fsdp_state.FSDPState, "_root_post_backward_final_callback", "FSDP2 root's end of backward")
    gc.callbacks.append(_on_gc)
    import torch._inductor.config as inductor_config

    inductor_config.cpp_wrapper = bool(os.environ.get("HOST_PHASES_CPP_WRAPPER")) or inductor_config.cpp_wrapper
    inductor_config.combo_kernels = bool(os.environ.get("HOST_PHASES_COMBO_KERNELS")) or inductor_config.combo_kernels

    if os.environ.get("HOST_PHASES_CUDAGRAPHS"):  # benchmarks/cudagraph_probe.py's change, this script's directory
        import cudagraph_probe

        cudagraph_probe._install()

    import moeshard.train.run as run

    inner, steps = run.train_step, []
    skip_guards_from = os.environ.get("HOST_PHASES_SKIP_GUARDS")

    sample = bool(os.environ.get("HOST_PHASES_SAMPLE"))
    skip = int(os.environ.get("HOST_PHASES_SKIP", "4"))
    if sample:
        sys.setswitchinterval(0.0005)
        threading.Thread(target=_sampler, daemon=True).start()

    def train_step(*args, **kwargs):
        _sampling["on"] = sample and len(steps) >= skip
        if skip_guards_from is not None and len(steps) == int(skip_guards_from):
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        before, gc0, t0 = dict(_acc), _gc["s"], time.perf_counter()
        out = inner(*args, **kwargs)
        spent = {k: v - before.get(k, 0.0) for k, v in _acc.items()}
        spent[("garbage collection", "any")] = _gc["s"] - gc0
        steps.append((time.perf_counter() - t0, spent))
        _sampling["on"] = False
        return out

    run.train_step = train_step
    return steps


def _report(steps: list[tuple[float, dict]]) -> None:
    skip, n = int(os.environ.get("HOST_PHASES_SKIP", "4")), int(os.environ.get("HOST_PHASES_STEPS", "6"))
    use = steps[skip : skip + n]
    if not use:
        return
    per_step = collections.defaultdict(float)
    for _, spent in use:
        for k, v in spent.items():
            per_step[k] += v * 1e3 / len(use)
    print(f"host: train_step {1e3 * sum(t for t, _ in use) / len(use):.1f} ms per step over {len(use)} steps")
    for (label, phase), ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"host: {label:<34} {phase}  {ms:8.1f} ms per step")
    top = int(os.environ.get("HOST_PHASES_TOP", "30"))
    for thread, total in _sampling["n"].most_common():
        if total < 50:
            continue
        for kind, table in (("inclusive", _incl), ("self", _self)):
            rows = sorted(((c, w) for (t, w), c in table.items() if t == thread), reverse=True)[:top]
            print(f"sampled {thread}, {total} samples, by {kind} share:")
            for c, w in rows:
                print(f"  {100 * c / total:5.1f}%  {w}")


if __name__ == "__main__":
    _steps = _install()
    atexit.register(_report, _steps)
    sys.argv = ["moeshard.train", *sys.argv[1:]]
    runpy.run_module("moeshard.train", run_name="__main__", alter_sys=True)
