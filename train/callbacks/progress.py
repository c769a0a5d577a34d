"""A progress bar on rank 0 (``train.progress``); while it is shown, console logging is written
above it (``tqdm.contrib.logging``) instead of through it."""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from train.callbacks.base import Callback, StepRecord

if TYPE_CHECKING:
    from train.trainer import Trainer


class ProgressBar(Callback):
    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None
        self.stack = ExitStack()

    def pre_train(self, trainer: Trainer, step: int) -> None:
        if not self.enabled:
            return
        self.stack.enter_context(logging_redirect_tqdm())
        self.bar = self.stack.enter_context(
            tqdm(
                total=trainer.total_steps,
                initial=step,
                unit="step",
                dynamic_ncols=True,
                leave=False,
            )
        )

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self, trainer: Trainer) -> None:
        self.stack.close()
        self.bar = None
