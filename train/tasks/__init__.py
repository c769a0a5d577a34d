"""What a run trains: ``lm`` (the early-fusion transformer) or ``vtok`` (the visual tokenizer)."""

from __future__ import annotations

from train.config import RunConfig
from train.dist import DistInfo
from train.tasks.base import StepOutput, Task


def build_task(cfg: RunConfig, dist: DistInfo) -> Task:
    if cfg.task == "vtok":
        from train.tasks.vtok import VtokTask

        return VtokTask(cfg, dist)
    from train.tasks.lm import LMTask

    return LMTask(cfg, dist)


__all__ = ["StepOutput", "Task", "build_task"]
