"""The run's opening line on the console and its resolved config in ``RUN_DIR/config.yaml``
(and ``RUN_DIR/pass_configs/``, one per pass)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from train.callbacks.base import Callback
from train.names import CONFIG_FILE, CONFIGS_DIR, pass_config_file, pass_config_step

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class RunInfo(Callback):
    def __init__(self, *, run_dir: Path, resolved_yaml: str, describe: str, is_main: bool) -> None:
        self.run_dir, self.resolved_yaml, self.describe, self.is_main = (
            run_dir,
            resolved_yaml,
            describe,
            is_main,
        )

    def pre_train(self, trainer: Trainer, step: int) -> None:
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(self.resolved_yaml)
        self.record_pass(step)
        log.info(f"{self.describe}, steps {step}->{trainer.total_steps}")

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        if self.is_main:  # the steps after ``step`` are trained again, under this pass's config
            self.record_pass(step)

    def record_pass(self, step: int) -> None:
        """Each pass's config stays (config.yaml is the latest's): a resume may change
        data.sources, and earlyfuse-report draws each pass's target mix over the steps it
        trained. Passes from ``step`` on are replaced by the one that goes on from it."""
        history = self.run_dir / CONFIGS_DIR
        history.mkdir(exist_ok=True)
        for old in history.iterdir():
            if (start := pass_config_step(old.name)) is not None and start >= step:
                old.unlink()
        (history / pass_config_file(step)).write_text(self.resolved_yaml)
