"""The training step with the experts' accumulating weight-gradient GEMMs on a second CUDA stream.

A torchrun target that runs ``moeshard.train``'s CLI (``bench`` or ``train``) with one change: where the expert MLP's
backward adds a weight gradient into the gradient already held (``ExpertPass._weight_grad`` with a buffer: the later
micro-batches of gradient accumulation), the kernel is launched on a side stream that first waits for the compute
stream, so that it can run beside the rest of that backward (the input-gradient GEMMs, the dispatch's backward, the
attention half's backward) instead of in line with it. Nothing waits for it until the backward ends: each
``torch.autograd.backward`` makes the compute stream wait for the side stream before it returns. The rows read on
the side stream are marked as used there (``record_stream``), so the allocator does not hand their memory on early.

The question: the accumulating kernel is partly bound by its traffic (it reads and writes the held gradient), the
GEMMs and attention beside it by their arithmetic; does running them together shorten micro-batch 1's step? The
first micro-batch's gradients (written, returned to autograd) stay on the compute stream, so micro-batch 4's step is
unchanged by construction.

    source benchmarks/gpu_env.sh
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/wgrad_stream_probe.py bench \\
        --parallel.compile=true --parallel.ep.kernels=triton --train.micro_batch_size=1 --steps 12 --warmup 4

A probe, not the design: it joins at the end of every backward and knows nothing of FSDP2's reduce of an expert unit
(with ep_fsdp > 1 the reduce would have to wait for the stream too).
"""

from __future__ import annotations

import functools
import runpy
import sys

import torch


def _install() -> None:
    from moeshard.ep import _mlp

    side: list[torch.cuda.Stream] = []
    original = _mlp.ExpertPass._weight_grad

    def weight_grad(self, a_NM, b_NK, into):
        if into is None or not a_NM.is_cuda:
            return original(self, a_NM, b_NK, into)
        if not side:
            side.append(torch.cuda.Stream(a_NM.device))
        stream, main = side[0], torch.cuda.current_stream(a_NM.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            out = original(self, a_NM, b_NK, into)
        for t in (a_NM, b_NK, self.offs):
            t.record_stream(stream)
        return out

    _mlp.ExpertPass._weight_grad = weight_grad
    backward = torch.autograd.backward

    @functools.wraps(backward)
    def joined(*args, **kwargs):
        out = backward(*args, **kwargs)
        if side:
            torch.cuda.current_stream(side[0].device).wait_stream(side[0])
        return out

    torch.autograd.backward = joined


if __name__ == "__main__":
    _install()
    sys.argv = ["moeshard.train", *sys.argv[1:]]
    runpy.run_module("moeshard.train", run_name="__main__", alter_sys=True)
