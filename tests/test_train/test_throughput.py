"""MFU is never shown above 100 % (train/callbacks/throughput.py): a measured CPU peak that a step
beats is measured again and raised to the best rate seen; a stated peak is kept, with a warning.
The RNG is untouched by the measurement."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from train.callbacks.base import StepRecord
from train.callbacks.throughput import Throughput
from train.mfu import MEASURED


def step(units: float) -> StepRecord:
    return StepRecord(sums={"units": units}, seconds=1.0, data_wait=0.1)


def test_a_step_faster_than_the_measured_peak_raises_it(caplog):
    meter = Throughput(
        flops_per_unit=1e12,
        world_size=1,
        device=torch.device("cpu"),
        configured_peak=0.0,
        is_main=True,
    )
    trainer = SimpleNamespace(total_steps=10)
    rng = torch.get_rng_state()
    meter.pre_train(trainer, 0)
    assert torch.equal(torch.get_rng_state(), rng)  # measured with a generator of its own
    assert meter.source == MEASURED and meter.peak > 0
    slow, fast = step(meter.peak / 2), step(meter.peak * 3)  # 1 unit = 1 TFLOP in 1 s
    meter.post_step(trainer, 1, slow)
    assert 0.45 < slow.metrics["throughput/mfu"] < 0.55
    meter.post_step(trainer, 2, fast)  # 3x what the matmul did: measured again, then raised
    assert fast.metrics["throughput/mfu"] == 1.0
    # the step's rate (1 unit = 1 TFLOP in 1 s), up to the rounding of flops / seconds / 1e12
    assert fast.metrics["throughput/peak_tflops"] >= fast.sums["units"] * (1 - 1e-12)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_stated_peak_is_kept_and_the_excess_said_once(caplog):
    meter = Throughput(
        flops_per_unit=1e12,
        world_size=1,
        device=torch.device("cpu"),
        configured_peak=2.0,
        is_main=True,
    )
    trainer = SimpleNamespace(total_steps=10)
    meter.pre_train(trainer, 0)
    records = [step(5.0), step(6.0)]
    with caplog.at_level(logging.WARNING):
        for i, record in enumerate(records, 1):
            meter.post_step(trainer, i, record)
    assert all(r.metrics["throughput/mfu"] == 1.0 for r in records)
    assert all(r.metrics["throughput/peak_tflops"] == 2.0 for r in records)
    assert caplog.text.count("above the stated peak") == 1
