"""The contract between the training loop and a task.

The loop knows nothing of images or tokens: it asks the task for a model, a resumable batch
stream, a forward pass that returns the loss plus *sums and counts* (reduced across ranks by
summing, never by averaging per-rank means), and turns those into metrics with the task.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from train.streams import BatchStream


@dataclass
class StepOutput:
    loss: torch.Tensor  # scalar with graph
    sums: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # detached scalars to sum over ranks
    units: int = 0  # tokens (or pixels) processed, for throughput


class Task(Protocol):
    unit: str  # "tok" or "img": what throughput counts

    def build_model(self) -> nn.Module: ...
    def batches(self) -> BatchStream: ...
    def forward(self, engine, batch: dict) -> StepOutput: ...
    def metrics(self, sums: dict[str, float]) -> dict[str, float]: ...
    def flops_per_unit(self) -> float: ...
    def evaluate(self, engine, step: int) -> dict[str, float]: ...
    def finish(self, engine, run_dir: Path) -> dict[str, float]: ...
    def extra_files(self) -> dict[str, str]: ...
    def state_dict(self) -> dict: ...  # this rank's task state for its checkpoint
    def load_state_dict(self, state: dict) -> None: ...
    def chance_levels(
        self,
    ) -> dict[str, float] | None: ...  # ln V per modality, for the collapse monitor
    def probes(self, monitor_cfg, engine): ...  # the monitor's probes, or None
