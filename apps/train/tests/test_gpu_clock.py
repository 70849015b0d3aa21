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


def test_nothing_without_a_gpu_or_a_command():
    for clocks in (ClockSampler(torch.device("cpu")), ClockSampler(torch.device("cpu"), command=["/nonexistent"])):
        clocks.start()
        clocks.stop()
        assert clocks.summary() == {}
