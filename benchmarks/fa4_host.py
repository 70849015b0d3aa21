"""Host time per call of the plain causal attention's kernels: SDPA (cuDNN), the model's ops over SDPA and over
FlashAttention 4, FlashAttention 4's entry points, ours (``fa4_forward`` / ``fa4_backward``, which call them), and
its compiled kernels called directly with the arguments its entry points handed them (what a path without the
entry points' host code would cost at the least).

    source benchmarks/gpu_env.sh && source benchmarks/fa4_env.sh .fa4 && python3 benchmarks/fa4_host.py

Qwen3-30B-A3B's attention shape (q ``[B, 32, S, 128]``, k and v ``[B, 4, S, 128]``, bf16). Each figure is the host's
wall time per call over ``--calls`` calls issued back to back without a synchronisation (the device runs behind:
the launch queue never fills at these counts), after one warm call; the device time per call is printed beside it.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

H, G, D = 32, 4, 128


def _host_and_device(fn, calls: int) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    end.record()
    torch.cuda.synchronize()
    return host * 1e6, start.elapsed_time(end) * 1e3 / calls


class _Recorder:
    """Wraps a compiled function of a FlashAttention 4 JIT cache: keeps the arguments of its last call."""

    def __init__(self, fn) -> None:
        self.fn, self.args = fn, None

    def __call__(self, *args):
        self.args = args
        return self.fn(*args)


def _record(cache) -> list[_Recorder]:
    out = []
    for key, fn in list(cache.cache.items()):
        rec = fn if isinstance(fn, _Recorder) else _Recorder(fn)
        cache.cache[key] = rec
        out.append(rec)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="4,1")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    from moeshard.models.common._fa4 import _interface

    interface = _interface()
    if isinstance(interface, str):
        raise SystemExit(interface)
    dev, S, scale = torch.device("cuda"), args.seq, D**-0.5
    print(f"{'B':>2} {'call':<58}{'host us':>9}{'device us':>11}")
    for B in (int(b) for b in args.batch.split(",")):
        _one_batch(B, S, scale, dev, args.calls, interface)


def _one_batch(B: int, S: int, scale: float, dev: torch.device, n: int, interface) -> None:
    from moeshard.models.common._fa4 import fa4_backward, fa4_forward
    from moeshard.models.common._kept import kept_causal_attention

    torch.manual_seed(0)
    q_s = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    k_s = torch.randn(B, S, G, D, device=dev, dtype=torch.bfloat16)
    v_s = torch.randn(B, S, G, D, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in (q_s, k_s, v_s))  # [B, heads, S, D] views, as the model has them
    dout_s = torch.randn_like(q_s)
    out_s, lse = fa4_forward(q_s, k_s, v_s, scale)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fb(kernel):
        def run():
            kept_causal_attention(qg, kg, vg, scale, kernel).backward(dout_s.transpose(1, 2))
            qg.grad = kg.grad = vg.grad = None

        return run

    calls = {
        "F.scaled_dot_product_attention (cuDNN), forward": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, scale=scale
        ),
        "kept_causal_attention sdpa, forward": lambda: kept_causal_attention(q, k, v, scale, "sdpa"),
        "kept_causal_attention fa4, forward": lambda: kept_causal_attention(q, k, v, scale, "fa4"),
        "flash_attn.cute _flash_attn_fwd (its entry point)": lambda: interface._flash_attn_fwd(
            q_s, k_s, v_s, softmax_scale=scale, causal=True, return_lse=True
        ),
        "flash_attn.cute _flash_attn_bwd (its entry point)": lambda: interface._flash_attn_bwd(
            q_s, k_s, v_s, out_s, dout_s, lse, softmax_scale=scale, causal=True
        ),
        "fa4_forward": lambda: fa4_forward(q_s, k_s, v_s, scale),
        "fa4_backward": lambda: fa4_backward(dout_s, q_s, k_s, v_s, out_s, lse, scale),
        "kept_causal_attention sdpa, forward + backward": fb("sdpa"),
        "kept_causal_attention fa4, forward + backward": fb("fa4"),
    }
    for name, fn in calls.items():
        host, device = _host_and_device(fn, n)
        print(f"{B:>2} {name:<58}{host:>9.0f}{device:>11.0f}")
    # The compiled kernels alone, with the arguments the entry points handed them on their last call.
    caches = {
        "forward kernel": interface._flash_attn_fwd.compile_cache,
        "backward kernel": interface._flash_attn_bwd.compile_cache,
        "backward pre-processing": interface._bwd_preprocess.compile_cache,
        "backward post-processing": interface._bwd_postprocess_convert.compile_cache,
    }
    recorders = {name: _record(cache) for name, cache in caches.items()}
    fa4_forward(q_s, k_s, v_s, scale)
    fa4_backward(dout_s, q_s, k_s, v_s, out_s, lse, scale)
    for name, recs in recorders.items():
        for i, rec in enumerate(r for r in recs if r.args is not None):
            host, device = _host_and_device(lambda rec=rec: rec.fn(*rec.args), n)
            print(f"{B:>2} {f'compiled {name} #{i}, called directly':<58}{host:>9.0f}{device:>11.0f}")
            rec.args = None


if __name__ == "__main__":
    main()
