"""When to checkpoint: every ``train.ckpt_every`` steps while the monitors call the run healthy
(a checkpoint taken mid-trouble is no place to roll back to), and at the end of the run. Every
save, this one's and a stop's alike, tells keep-last which older checkpoints to keep
(``Trainer.protect``: the monitor's ``protected_steps``, the newest one from before a trouble
still open). How a
checkpoint is written and read is ``train/checkpoint.py``'s (``Checkpointer``); what goes in it
is the trainer's (``Trainer.save_checkpoint``: the callbacks' states, the stream, the RNG)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from train.callbacks.base import Callback, StepRecord

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class Checkpointing(Callback):
    def __init__(
        self,
        *,
        every: int,
        healthy: Callable[[], bool],
        unhealthy_why: str,
        is_main: bool,
    ) -> None:
        self.every, self.healthy, self.unhealthy_why, self.is_main = (
            every,
            healthy,
            unhealthy_why,
            is_main,
        )

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if not self.every or step % self.every or step == trainer.total_steps:
            return
        if self.healthy():
            trainer.save_checkpoint(step)
        elif self.is_main:
            log.info(f"checkpoint at step {step} skipped: {self.unhealthy_why}")

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        if trainer.last_saved != step:  # a resumed run that had already finished has it
            trainer.save_checkpoint(step)
