"""Alarms: what a detector found, written to ``RUN_DIR/alarms.jsonl`` (one JSON object per line:
step, signal, modality, values, action, message, threshold, cause, advice, since) and shown on
the console for ``warn`` and up. Every alarm says what to do: the threshold it crossed, the
likely cause and the advice (what the action does, or what a person should check).
``earlyfuse-report`` reads the same file."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.monitor.config import SEVERITY
from train.names import ALARMS_FILE


@dataclass
class Alarm:
    step: int
    signal: str  # e.g. "collapse", "loss_spike", "dependence_gap"
    action: str  # log | warn | skip | rollback | halt
    message: str
    modality: str | None = None
    values: dict = field(default_factory=dict)
    since: int | None = None  # the step the trouble began (rollback looks before it)
    threshold: str = ""  # the rule that fired, with its numbers
    cause: str = ""  # the likely cause
    advice: str = ""  # what the action does / what a person should check

    def to_json(self) -> str:
        fields = asdict(self)
        fields["values"] = {
            key: (value if isinstance(value, (int, str)) or math.isfinite(value) else str(value))
            for key, value in self.values.items()
        }
        return json.dumps(fields, sort_keys=True)

    def line(self) -> str:
        where = f" [{self.modality}]" if self.modality else ""
        out = f"ALARM step {self.step} {self.signal}{where} -> {self.action}: {self.message}"
        if self.threshold:
            out += f" [rule: {self.threshold}]"
        if self.cause:
            out += f"\n  likely cause: {self.cause}"
        if self.advice:
            out += f"\n  what to do: {self.advice}"
        return out


def strongest(alarms: list[Alarm]) -> Alarm | None:
    return max(alarms, key=lambda a: SEVERITY[a.action], default=None)


class AlarmLog:
    """Appends alarms to the run folder (rank 0) and echoes those of ``warn`` and up."""

    def __init__(self, run_dir: Path, *, is_main: bool, write_line) -> None:
        self.path = Path(run_dir) / ALARMS_FILE
        self.is_main, self.write_line = is_main, write_line
        self.count = 0

    def record(self, alarms: list[Alarm], *, echo: bool = True) -> None:
        """``echo``: False for a record the console has said otherwise (a halt's line)."""
        self.count += len(alarms)
        if not self.is_main or not alarms:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for alarm in alarms:
                f.write(alarm.to_json() + "\n")
        for alarm in alarms if echo else []:
            if SEVERITY[alarm.action] >= SEVERITY["warn"]:
                self.write_line(alarm.line())

    def resume_at(self, count: int) -> None:
        """A resume from a checkpoint saved after ``count`` alarms (0: a run killed before its
        first): the file's later lines were written by the steps after that checkpoint, which
        the resumed run plays again (and raises again), so they go; except up to the last
        rollback or halt, whose abandoned steps are not played again as they were."""
        self.count = count
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        keep = max(
            count, max((i + 1 for i, line in enumerate(lines) if _ends_pass(line)), default=0)
        )
        self.count = keep
        if self.is_main and len(lines) > keep:
            kept = self.path.with_name(self.path.name + ".tmp")
            kept.write_text("".join(lines[:keep]))
            kept.replace(self.path)


def _ends_pass(line: str) -> bool:
    """Whether an alarms.jsonl line is a rollback's or a halt's."""
    try:
        return json.loads(line).get("action") in ("rollback", "halt")
    except (ValueError, AttributeError):
        return False
