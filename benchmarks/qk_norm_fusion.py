"""Qwen3-MoE's q path after its projection (per-head RMSNorm over 128, transpose, rotary), compiled, at 4 x 4,096
tokens x 32 heads: the projection's output from an in-graph GEMM (``F.linear``, as the model runs it) against the
same output from an opaque custom op (what full checkpointing's keep would hand the compiled half: an extern
buffer). On CPU Inductor fuses the two differently; on an H200 both run one persistent reduction (benchmarks/NOTES.md,
"The attention's projections kept under full checkpointing"). This times the norm-and-rotary kernels alone in each
form, and with ``persistent_reductions`` off.
    python3 benchmarks/qk_norm_fusion.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from triton.testing import do_bench


@torch.library.custom_op("qkprobe::opaque_linear", mutates_args=())
def opaque_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


@opaque_linear.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def q_path(lin, nw, cos, sin, b, s):
    q = lin.view(b, s, -1, 128).float()
    q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * nw
    q = q.transpose(1, 2)
    return q * cos + rotate_half(q) * sin


def main() -> None:
    b, s, d, hq = 4, 4096, 2048, 4096
    dev = "cuda"
    x = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(hq, d, device=dev, dtype=torch.bfloat16) / d**0.5
    nw = torch.randn(128, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(1, 1, s, 128, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(1, 1, s, 128, device=dev, dtype=torch.bfloat16)
    gemm = do_bench(lambda: F.linear(x, w))
    print(f"the q projection's GEMM alone: {gemm:.3f} ms")
    for persistent in (True, False):
        inductor_config.triton.persistent_reductions = persistent
        torch._dynamo.reset()
        in_graph = torch.compile(lambda: q_path(F.linear(x, w), nw, cos, sin, b, s))
        opaque = torch.compile(lambda: q_path(opaque_linear(x, w), nw, cos, sin, b, s))
        ref = in_graph()
        torch.testing.assert_close(opaque(), ref, rtol=0, atol=0)
        t_in, t_op = do_bench(in_graph), do_bench(opaque)
        print(
            f"persistent_reductions={persistent}: GEMM in the graph {t_in:.3f} ms (norm+rotary {t_in - gemm:.3f}), "
            f"from an opaque op {t_op:.3f} ms (norm+rotary {t_op - gemm:.3f})"
        )


if __name__ == "__main__":
    main()
