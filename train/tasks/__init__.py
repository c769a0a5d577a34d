"""What a run trains: ``lm`` (the early-fusion transformer) or ``vtok`` (the visual tokenizer)."""
from __future__ import annotations

from train.config import RunConfig
from train.dist import DistInfo
from train.tasks.base import StepOutput, Task


def build_task(cfg: RunConfig, dist: DistInfo) -> Task:
    if cfg.task == "vtok":
        from train.tasks.vtok import VtokTask
        return VtokTask(cfg, dist)
    raise ValueError("task 'lm' needs the streaming loader of token shards, which is not built yet; "
                     "task 'vtok' trains the visual tokenizer")


__all__ = ["StepOutput", "Task", "build_task"]
