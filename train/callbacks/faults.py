"""Fault injection, for the tests of resume and of the monitors (docs/monitors.md), and for the
instability suite. Never registered by a normal run: a test builds the trainer with it
(``tests/train_with_faults.py``: ``--fault NAME=STEP`` before the Hydra overrides). Faults are
transient: they do not recur once a rollback has abandoned the trajectory they were on.

    kill_at_step=k              die like kill -9 (SIGKILL) after step k (and its checkpoint)
    kill_after_rollback_at=k    the same, after step k of the trajectory a rollback went on with
    kill_in_save=k              die while saving step k's checkpoint: its files are written,
                                ``latest`` has not moved yet
    nan_at_step=k               the loss of step k is NaN
    lr_x100_at=k                lr x 100 for steps k .. k+19 (until a rollback)
    random_image_codes_from=k   from step k every image code is a random code (LM only)
    shuffle_probe_from=k        from step k the dependence probe's "matched" images are shuffled
    sigterm_at_start=1          a SIGTERM to this process while the run starts (before the
                                trainer exists, as a scheduler's preemption may come)
    sigterm_at_step=k           a SIGTERM to this process after step k (a preemption mid-run)
    rng_log=PATH                not a fault: before every step, append "STEP DIGEST" of the global
                                RNG states (torch, numpy, python) to PATH.RANK (resume tests)

Design choices:
- The faults reach into the run the way a test harness would, from the outside: the task's
  ``forward`` is wrapped (NaN loss, random codes), the optimizer's lr scaled before the update,
  the checkpointer given a hook between writing files and moving ``latest``. Nothing in the
  production path knows that faults exist.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from data.vocab import Modality
from train.callbacks.base import Callback, StepRecord
from train.tasks.base import StepOutput

if TYPE_CHECKING:
    from train.trainer import Trainer

LR_FAULT_STEPS = 20


@dataclass(kw_only=True)
class FaultConfig:
    """Steps are 1-based (the step being taken); -1: off."""

    kill_at_step: int = -1
    kill_after_rollback_at: int = -1
    kill_in_save: int = -1
    nan_at_step: int = -1
    lr_x100_at: int = -1
    random_image_codes_from: int = -1
    shuffle_probe_from: int = -1
    sigterm_at_start: int = -1
    sigterm_at_step: int = -1
    rng_log: str = ""

    @classmethod
    def parse(cls, items: list[str]) -> FaultConfig:
        """From ``NAME=VALUE`` strings, e.g. ``["kill_at_step=3"]``."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict = {}
        for item in items:
            name, _, value = item.partition("=")
            if name not in known:
                raise ValueError(f"unknown fault {name!r}; choose from {sorted(known)}")
            values[name] = value if name == "rng_log" else int(value)
        return cls(**values)


def rng_digest() -> str:
    """A short digest of the global RNG states every step of a run may draw from."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    _, key, pos, *_ = np.random.get_state(legacy=True)
    h.update(np.asarray(key).tobytes() + str(pos).encode())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()[:16]


def random_image_codes(batch: dict, layout, generator: torch.Generator) -> dict:
    """Every image code of the batch replaced by a random code; labels stay the next input."""
    ids = batch["input_ids"]
    is_code = (batch["modality"] == int(Modality.IMAGE)) & (ids >= layout.visual_offset)
    rnd = torch.randint(layout.visual_offset, layout.size, ids.shape, generator=generator)
    ids = torch.where(is_code, rnd, ids)
    labels = batch["labels"].clone()
    shifted = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    label_code = (batch["label_modality"] == int(Modality.IMAGE)) & (labels >= layout.visual_offset)
    labels[label_code] = shifted[label_code]
    return {**batch, "input_ids": ids, "labels": labels}


class FaultInjection(Callback):
    def __init__(self, cfg: FaultConfig, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self.rolled_back = False
        if cfg.sigterm_at_start > 0:  # made by train.app before the trainer is built
            os.kill(os.getpid(), signal.SIGTERM)

    # --- wiring, at the start ----------------------------------------------------------------
    def pre_train(self, trainer: Trainer, step: int) -> None:
        c = self.cfg
        if c.nan_at_step >= 0 or c.random_image_codes_from >= 0:
            self.wrap_forward(trainer)
        if c.kill_in_save >= 0:
            trainer.checkpointer.before_commit = self.kill_in_save
        if c.shuffle_probe_from >= 0:
            from train.callbacks.monitoring import Monitoring

            for monitoring in trainer.callbacks.find(Monitoring):
                monitoring.monitor.probes.shuffle_matched_from = c.shuffle_probe_from

    def wrap_forward(self, trainer: Trainer) -> None:
        task = trainer.task
        forward = task.forward
        layout = None
        if self.cfg.random_image_codes_from >= 0:
            from train.tasks.lm import LMTask

            if not isinstance(task, LMTask):
                raise ValueError("fault random_image_codes_from: an LM run only (image codes)")
            layout = task.layout

        def faulty_forward(engine, batch: dict) -> StepOutput:
            codes_from = self.cfg.random_image_codes_from
            if layout is not None and 0 <= codes_from <= self.step:
                batch = random_image_codes(batch, layout, self.generator)
            out = forward(engine, batch)
            if self.step == self.cfg.nan_at_step:
                out = StepOutput(loss=out.loss * float("nan"), sums=out.sums, units=out.units)
            return out

        task.forward = faulty_forward  # type: ignore[method-assign]

    # --- every step --------------------------------------------------------------------------
    def pre_step(self, trainer: Trainer, step: int) -> None:
        self.step = step
        if self.cfg.rng_log:
            path = Path(f"{self.cfg.rng_log}.{trainer.dist.rank}")
            with path.open("a") as f:
                f.write(f"{step} {rng_digest()}\n")
        lr_at = self.cfg.lr_x100_at
        if not self.rolled_back and 0 <= lr_at <= step < lr_at + LR_FAULT_STEPS:
            # The scheduler sets the lr again after this step's update.
            for group in trainer.optimizer.param_groups:
                group["lr"] *= 100.0

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if step == self.cfg.kill_at_step or (
            self.rolled_back and step == self.cfg.kill_after_rollback_at
        ):
            os.kill(os.getpid(), signal.SIGKILL)  # dies like kill -9: no cleanup, no flush
        if step == self.cfg.sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # the run stops after its next step

    def kill_in_save(self, step: int) -> None:
        if step == self.cfg.kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        self.rolled_back = True
