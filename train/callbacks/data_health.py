"""What the data stream reports beyond batches: the unreadable samples skipped (``data/skipped``:
how many distinct samples, over all ranks, at every log step and in final.json; a console line
naming the new ones when the count grows) and, in final.json, the share of each source in
the tokens the handed-out rows held (``data/mix/<s>``: what the per-step ``mix/<s>`` average to,
weighted by tokens).

A sample is counted once however often it is met (a later epoch reads it again, a resume may
read it again): the loaders' states name the samples they skipped, and the names are gathered
over ranks at log steps only (one small collective), never every step."""

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
NAMED = 10  # new skipped samples named in one console line, then a count


def gather_names(names: set[str]) -> set[str]:
    """The union of every rank's ``names`` (a collective when there are several ranks)."""
    import torch.distributed as tdist

    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return set(names)
    parts: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, sorted(names))
    return {name for part in parts for name in part}


class DataHealth(Callback):
    def __init__(
        self, stream: BatchStream, *, log_every: int, device: torch.device, is_main: bool
    ) -> None:
        self.stream, self.log_every, self.device, self.is_main = stream, log_every, device, is_main
        self.shown: set[str] = set()

    def skipped(self) -> set[str]:
        """The unreadable samples the loaders skipped so far, over all ranks (a collective)."""
        return gather_names(self.stream.skipped())

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        if step % self.log_every and step != trainer.total_steps:
            return
        skipped = self.skipped()
        record.metrics["data/skipped"] = float(len(skipped))
        new = sorted(skipped - self.shown)
        if new and self.is_main:
            self.shown |= skipped
            named = ", ".join(new[:NAMED]) + (
                f" and {len(new) - NAMED} more" if len(new) > NAMED else ""
            )
            log.info(
                f"data: {len(skipped)} unreadable sample(s) skipped so far, over all ranks, each "
                f"counted once; new: {named} (why: on stderr, '[loader] skipped SHARD sample KEY')"
            )

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        final["data/skipped"] = float(len(self.skipped()))
        delivered = self.stream.delivered()
        names = sorted(delivered)
        if len(names) > 1:
            counts = all_reduce_sum(
                torch.tensor([delivered[n] for n in names], dtype=torch.float64, device=self.device)
            ).tolist()
            total = sum(counts) or 1.0
            final.update({f"data/mix/{n}": c / total for n, c in zip(names, counts)})
