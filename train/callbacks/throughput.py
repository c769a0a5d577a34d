"""Speed of every step: units (tokens or images) per second, step time, the share spent waiting
for data, model FLOPs utilisation (MFU) against a stated peak, and the time left.

Design choices:
- MFU = model FLOPs per second per device / the device's peak. A GPU's peak is the vendor's dense
  bf16 figure; ``train.peak_tflops`` states another. A CPU has no such figure: its peak is measured
  (an fp32 matmul, ``train/mfu.py``) when the run starts. On a shared machine that measurement can
  come out low (other jobs held the cores for that moment), and a step would then show more than
  100 %. So whenever a step runs faster than the measured peak, the matmul is measured again (at
  most every ``REMEASURE_EVERY`` steps, outside the step's timing, never drawing from the global
  RNG) and the peak becomes the best rate seen, by the matmul or by the model's own step: an
  honest lower bound of what the machine can do, and MFU can never exceed 100 %.
- A configured or vendor peak is not second-guessed: a step above it (a wrong
  ``train.peak_tflops``) is shown as 100 % with one warning that says so.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from train.callbacks.base import Callback, StepRecord
from train.mfu import MEASURED, measure_cpu_tflops, peak_tflops

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)
REMEASURE_EVERY = 50  # steps between two extra measurements of a CPU peak


class Throughput(Callback):
    def __init__(
        self,
        *,
        flops_per_unit: float,
        world_size: int,
        device: torch.device,
        configured_peak: float,
        is_main: bool,
    ) -> None:
        self.flops_per_unit, self.world_size = flops_per_unit, world_size
        self.device, self.configured_peak, self.is_main = device, configured_peak, is_main
        self.peak, self.source = 0.0, ""
        self.time_sum, self.steps_timed = 0.0, 0
        self.next_measure = 0
        self.warned = False

    def pre_train(self, trainer: Trainer, step: int) -> None:
        self.peak, self.source = peak_tflops(self.configured_peak, self.device)
        if self.is_main:
            log.info(f"MFU is stated against a peak of {self.peak:.2f} TFLOP/s ({self.source})")

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        seconds = max(record.seconds, 1e-9)
        units_per_s = record.sums["units"] / seconds
        self.time_sum += record.seconds
        self.steps_timed += 1
        achieved = units_per_s * self.flops_per_unit / 1e12 / self.world_size
        self.keep_under_peak(step, achieved)
        mean_step = self.time_sum / self.steps_timed
        record.metrics.update(
            {
                "throughput/units_per_s": units_per_s,
                "throughput/step_s": record.seconds,
                "throughput/data_wait": record.data_wait / seconds,
                "throughput/peak_tflops": self.peak,
                "throughput/mfu": min(1.0, achieved / self.peak) if self.peak else math.nan,
                "throughput/eta_s": mean_step * (trainer.total_steps - step),
            }
        )

    def keep_under_peak(self, step: int, achieved: float) -> None:
        """A step faster than the peak: a measured peak is measured again and raised to the best
        rate seen; a stated one is kept, with a warning (see the module docstring)."""
        if not self.peak or achieved <= self.peak:
            return
        if self.source == MEASURED:
            if step >= self.next_measure:
                self.peak = max(self.peak, measure_cpu_tflops())
                self.next_measure = step + REMEASURE_EVERY
            self.peak = max(self.peak, achieved)
        elif not self.warned and self.is_main:
            self.warned = True
            log.warning(
                f"step {step} ran at {achieved:.3g} TFLOP/s per device, above the stated peak of "
                f"{self.peak:.3g} ({self.source}): MFU is shown as at most 100 %; check "
                "train.peak_tflops"
            )
