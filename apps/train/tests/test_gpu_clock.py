"""The GPU clock and power sampler of ``bench`` (``observe.gpu_clock``): nvidia-smi's lines parsed, a sampling
process read in the background and stopped, and nothing on a machine without a GPU."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from moeshard.train.observe.gpu_clock import ClockSample, ClockSampler, parse_sample

LINES = [
    "1725, 1980, 688.75, 700.00, 0x0000000000000004",
    "1980, 1980, 124.55, 700.00, 0x0000000000000000",
    "1410, 1980, 687.15, 700.00, 0x0000000000000024",
]


def test_lines_parse_and_others_do_not():
    assert parse_sample(LINES[0]) == ClockSample(1725, 1980, 688.75, 700.0, 4)
    for line in ("clocks.sm [MHz], power.draw [W]", "1725, 1980, [N/A], 700.00, 0x0", "No devices were found", ""):
        assert parse_sample(line) is None


def test_a_sampling_process_is_read_then_stopped():
    # A stand-in for nvidia-smi -lms: the three samples and a line that is not one, then it keeps running.
    text = "\n".join(["oops", *LINES])
    script = f"import time; print({text!r}, flush=True); time.sleep(60)"
    clocks = ClockSampler(torch.device("cpu"), command=[sys.executable, "-c", script])
    clocks.start()
    for _ in range(200):
        if len(clocks.samples) == 3:
            break
        time.sleep(0.05)
    clocks.stop()
    r = clocks.summary()
    assert r["gpu_clock_samples"] == 3 and r["gpu_sm_clock_mhz_min"] == 1410
    assert r["gpu_sm_clock_mhz_mean"] == pytest.approx((1725 + 1980 + 1410) / 3)
    assert r["gpu_power_capped_share"] == pytest.approx(2 / 3) and r["gpu_thermal_share"] == pytest.approx(1 / 3)
    assert r["gpu_power_limit_w"] == 700.0 and r["gpu_sm_clock_mhz_max_possible"] == 1980
    assert "gpu_energy_j_per_step" not in r
    energy = clocks.summary(step_s=0.25)["gpu_energy_j_per_step"]
    assert energy == pytest.approx(0.25 * (688.75 + 124.55 + 687.15) / 3)


def test_bench_prints_the_clock_power_and_energy_line(capsys):
    from moeshard.train.commands.bench import _report

    result = {
        "layers": 8, "seq_len": 4096, "world_size": 1, "ep_size": 1, "ep_fsdp_size": 1, "batch_per_gpu": 4,
        "micro_batch": 4, "step_time_s_median": 0.2, "step_times_s": [0.2, 0.21], "tokens_per_s_per_gpu": 81920.0,
        "mfu": 0.44, "peak_allocated_gib": 80.0, "peak_reserved_gib": 82.0, "syncs_per_step": 0,
        "host_time_s_median": None, "gpu_sm_clock_mhz_mean": 1741.0, "gpu_sm_clock_mhz_min": 1410.0,
        "gpu_sm_clock_mhz_max_possible": 1980.0, "gpu_power_w_mean": 665.0, "gpu_power_limit_w": 700.0,
        "gpu_power_capped_share": 0.98, "gpu_energy_j_per_step": 133.0,
    }  # fmt: skip
    _report(result, None, isolated=False)
    line = capsys.readouterr().out.splitlines()[1]
    assert (
        line
        == "SM clock 1741 MHz (min 1410, max 1980) | 665 W of 700, power-capped in 98% of samples | ~133 J per step"
    )


def test_nothing_without_a_gpu_or_a_command():
    for clocks in (ClockSampler(torch.device("cpu")), ClockSampler(torch.device("cpu"), command=["/nonexistent"])):
        clocks.start()
        clocks.stop()
        assert clocks.summary() == {}
