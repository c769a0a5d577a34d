"""The run's opening line on the console, its resolved config in ``RUN_DIR/config.yaml`` (and
``RUN_DIR/pass_configs/``, one per pass) and how each start was made in ``RUN_DIR/launches.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from train.callbacks.base import Callback
from train.names import (
    CONFIG_FILE,
    CONFIGS_DIR,
    LAUNCHES_FILE,
    pass_config_file,
    pass_config_step,
)

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class RunInfo(Callback):
    def __init__(
        self,
        *,
        run_dir: Path,
        resolved_yaml: str,
        describe: str,
        is_main: bool,
        command: Sequence[str] = (),
        world_size: int = 1,
    ) -> None:
        self.run_dir, self.resolved_yaml, self.describe, self.is_main = (
            run_dir,
            resolved_yaml,
            describe,
            is_main,
        )
        self.command, self.world_size = list(command), world_size

    def pre_train(self, trainer: Trainer, step: int) -> None:
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if step < trainer.total_steps:  # a complete run started again trains nothing under it:
            # its config.yaml stays the one that trained (a rerun from it must start)
            (self.run_dir / CONFIG_FILE).write_text(self.resolved_yaml)
            self.record_pass(step)
        with open(self.run_dir / LAUNCHES_FILE, "a") as f:
            f.write(json.dumps(launch_record(step, self.command, self.world_size)) + "\n")
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


def launch_record(step: int, command: Sequence[str], world_size: int) -> dict:
    """How one start of the run was made: the config holds what was resolved, not the command,
    the folder its relative paths (data shards, run_dir, init_from) were read from, or the code
    that ran, and the same command from the same folder is how a run is resumed or repeated."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "step": step,
        "arguments": shlex.join(command),  # earlyfuse-train's (train.app's under a launcher)
        "cwd": os.getcwd(),
        "host": platform.node(),
        "world_size": world_size,
        "nodes": nodes(world_size),
        **code_identity(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "deepspeed": package_version("deepspeed"),
    }


def code_identity() -> dict:
    """Which earlyfuse made a record: its version, and the commit of the checkout it ran from
    with whether that checkout had changes (both None for an installed copy)."""
    commit, modified = code_commit()
    return {"earlyfuse": package_version("earlyfuse"), "commit": commit, "modified": modified}


def nodes(world_size: int) -> int | None:
    """Nodes the run spans, from the processes per node its launcher names (torchrun's
    LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE); None when it names none."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
    return world_size // int(local) if local and local.isdigit() and int(local) else None


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


CHECKOUT = Path(__file__).resolve().parents[2]  # train/callbacks/ -> the code's own folder


def code_commit(checkout: Path = CHECKOUT) -> tuple[str | None, bool | None]:
    """The git commit of the checkout the code runs from, and whether its tracked files differ
    from it; (None, None) for an installed copy, or where git is missing or slow. No optional
    locks: the user's own git command in that checkout at the same moment must not fail."""
    if not (checkout / ".git").exists():
        return None, None
    try:
        git = ["git", "--no-optional-locks", "-C", str(checkout)]
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if head.returncode or status.returncode:
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip())
