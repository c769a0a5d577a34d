"""The step's own metrics, first in every step's record: the task's (loss per modality, tokens,
delivered mix, ...), ``train/loss``, the lr, and what the skip-step gate saw and decided."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from train.callbacks.base import Callback, StepRecord
from train.skip_step import SkipStepRule, UpdateGate

if TYPE_CHECKING:
    from train.trainer import Trainer


class StepMetrics(Callback):
    def __init__(self, *, task_metrics: Callable[[dict], dict], lr: Callable[[], float]) -> None:
        self.task_metrics, self.lr = task_metrics, lr

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        sums = record.sums
        record.metrics.update(self.task_metrics(sums))
        record.metrics["train/loss"] = sums["loss_sum"] / sums["micro"]
        record.metrics["optim/lr"] = self.lr()


class SkipStep(Callback):
    """The OLMo-style skip-step rule (``train/skip_step.py``): the gate decides inside the
    optimizer step; this callback logs its decision and checkpoints the rule's statistics."""

    state_key = "skip_step"

    def __init__(self, rule: SkipStepRule, gate: UpdateGate) -> None:
        self.rule, self.gate = rule, gate

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        record.metrics["optim/grad_norm"] = self.gate.grad_norm
        record.metrics["optim/skipped_steps"] = self.rule.skipped
        record.metrics["optim/skipped"] = float(bool(self.gate.decision))

    def on_mix_change(self, trainer: Trainer, step: int) -> None:
        self.rule.restart_losses()

    def state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)
