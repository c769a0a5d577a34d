"""The peak throughput MFU is stated against.

GPUs: the vendor's dense bf16 peak for known parts. CPUs have no such figure, so we measure
a float32 matmul for a moment and say so in the console line ("measured").

Design choices:
- The measurement draws its matrices from a generator of its own: a run's global RNG stream is
  the same whether or not (and whenever) the peak is measured, so a resumed run draws exactly what
  the uninterrupted one drew.
- A busy machine measures low. ``train.callbacks.throughput`` therefore measures again whenever
  a step ran faster than the measured peak, and keeps the best rate seen; see there.
"""

from __future__ import annotations

import time

import torch

# Dense (non-sparse) bf16 TFLOP/s.
GPU_PEAKS = {
    "H200": 989.4,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "4090": 165.2,
}
MEASURED = "measured fp32 matmul"


def measure_cpu_tflops(seconds: float = 0.4, n: int = 1024, tries: int = 4) -> float:
    """The best of ``tries`` short windows of n x n float32 matmuls: a shared machine's other jobs
    only ever slow a window down, and small matrices understate what the cores can do (at 512 a
    convolutional model showed over 100 % "MFU")."""
    own = torch.Generator().manual_seed(0)  # never the global RNG (see the module docstring)
    a, b = torch.randn(n, n, generator=own), torch.randn(n, n, generator=own)
    a @ b
    best = 0.0
    for _ in range(tries):
        reps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds / tries:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - started) / 1e12)
    return best


def peak_tflops(configured: float, device: torch.device) -> tuple[float, str]:
    if configured > 0:
        return configured, "configured"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, val in GPU_PEAKS.items():
            if key in name:
                return val, f"{key} dense bf16"
        return 0.0, f"unknown GPU {name}: set train.peak_tflops"
    return measure_cpu_tflops(), MEASURED
