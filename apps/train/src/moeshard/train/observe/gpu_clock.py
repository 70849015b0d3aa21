"""The GPU's SM clock and power while steps run: whether the power limit set their pace.

A sustained bf16 step can draw the GPU's whole power limit (the H200's is 700 W): the driver then lowers the SM clock
(throttle reason "SW power cap") and kernels bound by arithmetic run slower than their ceilings measured at full
clock. :class:`ClockSampler` reads ``nvidia-smi``'s own sampling (``-lms``, one background process) while it runs
and summarises it; where ``nvidia-smi`` is absent or fails (CPU) it reports nothing.

    clocks = ClockSampler(device)
    clocks.start(); <the timed steps>; clocks.stop()
    clocks.summary()  # {"gpu_sm_clock_mhz_mean": 1741.0, ..., "gpu_power_capped_share": 0.98}, or {}

``moeshard-train bench`` samples its timed steps and prints the summary under its figures.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from dataclasses import dataclass

import torch

__all__ = ["ClockSample", "ClockSampler", "parse_sample"]

QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active"
"""What each sample holds, in ``nvidia-smi --query-gpu`` terms."""
SW_POWER_CAP = 0x4
THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown
"""Throttle-reason bits (NVML's ``nvmlClocksThrottleReason*``) the summary counts."""


@dataclass(frozen=True)
class ClockSample:
    """One sample: SM clock and its maximum (MHz), power drawn and its limit (W), the active throttle reasons."""

    sm_mhz: int
    max_sm_mhz: int
    power_w: float
    limit_w: float
    reasons: int


def parse_sample(line: str) -> ClockSample | None:
    """A sample from one line of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits``, or None where the
    line is not one (a header, an error, ``[N/A]``)."""
    fields = [f.strip() for f in line.split(",")]
    if len(fields) != 5:
        return None
    try:
        return ClockSample(int(fields[0]), int(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16))
    except ValueError:
        return None


class ClockSampler:
    """Samples the SM clock and power of ``device`` between :meth:`start` and :meth:`stop`.

    Args:
        device: the GPU; on any other device the sampler does nothing.
        interval_ms: nvidia-smi's sampling period.
        command: the sampling command (default ``nvidia-smi`` for ``device``); it prints one sample per line.
    """

    def __init__(self, device: torch.device, interval_ms: int = 200, command: list[str] | None = None) -> None:
        self.samples: list[ClockSample] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        if command is None and device.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
            which = f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())
            command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", which]
            command += ["-lms", str(interval_ms)]
        self.command = command

    def start(self) -> None:
        """Start sampling (nothing where there is no command, or it cannot start)."""
        if self.command is None or self._proc is not None:
            return
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        """Stop sampling; the samples so far stay."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._proc = self._thread = None

    def summary(self, step_s: float | None = None) -> dict[str, float]:
        """Mean and minimum SM clock and its maximum, mean and peak power and the limit, and the shares of samples
        the power cap and thermal slowdown throttled; with ``step_s`` (the median step), the energy of a step by
        the mean power (``gpu_energy_j_per_step``: a lever that saves energy leaves the capped clock higher). Empty
        without samples."""
        s = self.samples
        if not s:
            return {}
        energy = {} if step_s is None else {"gpu_energy_j_per_step": statistics.fmean(x.power_w for x in s) * step_s}
        return energy | {
            "gpu_sm_clock_mhz_mean": statistics.fmean(x.sm_mhz for x in s),
            "gpu_sm_clock_mhz_min": float(min(x.sm_mhz for x in s)),
            "gpu_sm_clock_mhz_max_possible": float(max(x.max_sm_mhz for x in s)),
            "gpu_power_w_mean": statistics.fmean(x.power_w for x in s),
            "gpu_power_w_peak": max(x.power_w for x in s),
            "gpu_power_limit_w": max(x.limit_w for x in s),
            "gpu_power_capped_share": sum(bool(x.reasons & SW_POWER_CAP) for x in s) / len(s),
            "gpu_thermal_share": sum(bool(x.reasons & THERMAL) for x in s) / len(s),
            "gpu_clock_samples": float(len(s)),
        }
