"""Evaluation every ``train.eval_every`` steps (its metrics join that step's record) and once at
the end (into final.json). What is evaluated is the task's business (``Task.evaluate``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from train.callbacks.base import Callback, StepRecord

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class Evaluation(Callback):
    def __init__(
        self, evaluate: Callable[..., dict[str, float]], *, every: int, is_main: bool
    ) -> None:
        self.evaluate, self.every, self.is_main = evaluate, every, is_main

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if self.every and step % self.every == 0 and step != trainer.total_steps:
            record.metrics.update(self.run(trainer, step))

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        final.update(self.run(trainer, step))

    def run(self, trainer: Trainer, step: int) -> dict[str, float]:
        trainer.engine.eval()
        with torch.no_grad():
            out = self.evaluate(trainer.engine, step)
        trainer.engine.train()
        if self.is_main and out:
            log.info(f"eval @ {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()))
        return out
