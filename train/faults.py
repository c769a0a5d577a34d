"""Fault injection, for the tests of resume and of the monitors (docs/monitors.md). Each fault is
an environment variable holding a step; unset, nothing happens. Faults are transient: they do
not recur once a rollback has abandoned the trajectory they were on.

    EARLYFUSE_FAULT_KILL_AT_STEP=k          die like kill -9 after step k
    EARLYFUSE_FAULT_KILL_IN_SAVE=k          die while saving step k's checkpoint
    EARLYFUSE_FAULT_NAN_AT_STEP=k           the loss of step k is NaN
    EARLYFUSE_FAULT_LR_X100_AT=k            lr x 100 for steps k .. k+19 (until a rollback)
    EARLYFUSE_FAULT_RANDOM_IMAGE_CODES_FROM=k   from step k every image code is a random code
    EARLYFUSE_FAULT_SHUFFLE_PROBE_FROM=k    from step k the dependence probe's "matched" images are shuffled
"""

from __future__ import annotations

import os

import torch

from data.vocab import Modality

LR_FAULT_STEPS = 20


def fault_step(var: str) -> int:
    return int(os.environ.get(var, "-1"))


class Faults:
    def __init__(self, seed: int = 0) -> None:
        self.nan_at = fault_step("EARLYFUSE_FAULT_NAN_AT_STEP")
        self.lr_at = fault_step("EARLYFUSE_FAULT_LR_X100_AT")
        self.codes_from = fault_step("EARLYFUSE_FAULT_RANDOM_IMAGE_CODES_FROM")
        self.gen = torch.Generator().manual_seed(seed)
        self.rolled_back = False

    def batch(self, step: int, batch: dict, layout) -> dict:
        """Step ``step`` (1-based, the step being taken) gets random image codes from the fault on."""
        if self.codes_from < 0 or step < self.codes_from or layout is None:
            return batch
        ids = batch["input_ids"]
        is_code = (batch["modality"] == int(Modality.IMAGE)) & (ids >= layout.visual_offset)
        rnd = torch.randint(layout.visual_offset, layout.size, ids.shape, generator=self.gen)
        ids = torch.where(is_code, rnd, ids)
        labels = batch["labels"].clone()
        shifted = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        lab_code = (batch["label_modality"] == int(Modality.IMAGE)) & (
            labels >= layout.visual_offset
        )
        labels[lab_code] = shifted[lab_code]  # labels stay the next input token
        return {**batch, "input_ids": ids, "labels": labels}

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == self.nan_at else loss

    def lr_scale(self, step: int) -> float:
        live = not self.rolled_back and 0 <= self.lr_at <= step < self.lr_at + LR_FAULT_STEPS
        return 100.0 if live else 1.0
