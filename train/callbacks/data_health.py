"""What the data stream reports beyond batches: unreadable samples skipped (``data/skipped``,
summed over ranks, at every log step and in final.json, with a console line when the count
grows) and, in final.json, the share of each source in everything delivered (``data/mix/<s>``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from train.callbacks.base import Callback, StepRecord
from train.dist import all_reduce_sum
from train.streams import BatchStream

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class DataHealth(Callback):
    def __init__(
        self, stream: BatchStream, *, log_every: int, device: torch.device, is_main: bool
    ) -> None:
        self.stream, self.log_every, self.device, self.is_main = stream, log_every, device, is_main
        self.shown = 0.0

    def skipped(self) -> float:
        """Unreadable samples the loaders skipped so far, summed over ranks (a collective)."""
        count = torch.tensor([float(self.stream.skipped())], device=self.device)
        return float(all_reduce_sum(count).item())

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if step % self.log_every and step != trainer.total_steps:
            return
        skipped = record.metrics["data/skipped"] = self.skipped()
        if skipped > self.shown and self.is_main:
            self.shown = skipped
            log.info(
                f"data: {int(skipped)} unreadable sample(s) skipped so far, over all ranks (each "
                "named on stderr as '[loader] skipped SHARD sample KEY: why')"
            )

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        final["data/skipped"] = self.skipped()
        delivered = self.stream.delivered()
        names = sorted(delivered)
        if len(names) > 1:
            counts = all_reduce_sum(
                torch.tensor([delivered[n] for n in names], dtype=torch.float64, device=self.device)
            ).tolist()
            total = sum(counts) or 1.0
            final.update({f"data/mix/{n}": c / total for n, c in zip(names, counts)})
