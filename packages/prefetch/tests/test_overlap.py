"""Exposed all-gather time from a synthetic profiler trace (the GPU script's measure)."""

import json

import pytest

from moeshard.prefetch import analyze_comm_overlap


def _kernel(name, ts_us, dur_us, stream):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts_us,
        "dur": dur_us,
        "tid": stream,
        "args": {"stream": stream},
    }


TRACE = {
    "traceEvents": [
        # compute stream 7: busy [0, 100) and [150, 200)
        _kernel("void at::native::gemm_kernel", 0, 60, 7),
        _kernel("void at::native::elementwise", 60, 40, 7),
        _kernel("void flash_fwd_kernel", 150, 50, 7),
        # all-gather stream 20: [80, 130) (30 us hidden, 20 us exposed) and [120, 160) (overlaps the first)
        _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 80, 50, 20),
        _kernel("ncclKernel_AllGather_RING_LL_Sum_int8_t", 120, 40, 20),
        # reduce-scatter on stream 21: [200, 230), fully exposed; a copy-in kernel on a side stream is not compute
        _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 200, 30, 21),
        _kernel("void at::native::chunk_cat_cuda_kernel", 130, 20, 22),
        # CPU ops and runtime calls are ignored
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5, "tid": 1},
    ]
}


def test_exposed_all_gather(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    for source in (TRACE, path, str(path)):
        got = analyze_comm_overlap(source)
        assert got.compute_stream == 7 and got.num_kernels == 7 and got.num_all_gather_kernels == 2
        assert got.compute_s == pytest.approx(150e-6)
        assert got.all_gather_s == pytest.approx(80e-6)  # [80, 160)
        assert got.exposed_all_gather_s == pytest.approx(50e-6)  # [100, 150)
        assert got.comm_s == pytest.approx(110e-6)
        assert got.exposed_comm_s == pytest.approx(80e-6)  # + [200, 230)
        assert got.window_s == pytest.approx(230e-6)
        assert json.loads(json.dumps(got.as_dict())) == got.as_dict()


def test_trace_without_kernels():
    got = analyze_comm_overlap({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
    assert got.compute_stream is None and got.exposed_all_gather_s == 0.0 and got.window_s == 0.0
