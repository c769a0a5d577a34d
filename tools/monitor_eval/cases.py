"""The instability suite's cases (listed in ``cases.yaml``), the healthy mixes they read and the
overrides that turn the monitors' actions off."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from train.monitor.config import DETECTORS

# Healthy mixes: (token folder under the suite's data root, {source: weight}). ``suite`` holds
# the sources of instab_healthy; ``suite_tv`` the same tokenized by a trained visual tokenizer
# (tools/monitor_eval/data.py), plus ``scenes`` alone.
_SOURCES = ("code", "text", "images", "clips", "docs", "colours", "colours_first")
_BASE = (0.25, 0.25, 0.2, 0.1, 0.1, 0.05, 0.05)
MIXES: dict[str, tuple[str, dict[str, float]]] = {
    "base": ("suite", dict(zip(_SOURCES, _BASE))),
    "text-heavy": ("suite", dict(zip(_SOURCES, (0.15, 0.45, 0.15, 0.05, 0.1, 0.05, 0.05)))),
    "image-heavy": ("suite", dict(zip(_SOURCES, (0.15, 0.15, 0.35, 0.1, 0.1, 0.1, 0.05)))),
    "code-heavy": ("suite", dict(zip(_SOURCES, (0.45, 0.15, 0.15, 0.05, 0.1, 0.05, 0.05)))),
    "text-only": ("suite", {"text": 1.0}),
    "code-only": ("suite", {"code": 1.0}),
    "video-only": ("suite", {"clips": 1.0}),
    "trained-base": ("suite_tv", dict(zip(_SOURCES, _BASE))),
    "code-text-scenes": ("suite_tv", {"code": 1.0, "text": 1.0, "scenes": 1.0}),
    "code-text-colours": ("suite_tv", {"code": 1.0, "text": 1.0, "colours": 1.0}),
    "images-small": ("suite_tv", {"code": 0.45, "text": 0.45, "images": 0.05, "colours": 0.05}),
    # The base corpus as tokenized (trained visual tokenizer), long text and code documents whole:
    # what a user's own data is, before the suite cuts it into pieces.
    "whole-code-text-scenes": ("base/tokens_tv", {"code": 1.0, "text": 1.0, "scenes": 1.0}),
}


def mix_override(mix: str, root: str, *, validation: bool = True) -> list[str]:
    """``data.sources=[...]`` for a named mix of the healthy sources under ``root`` (the suite's
    data root), and ``data.validation`` from the mix's folder (none: ``validation`` false, the
    probes then read the training sources)."""
    folder, weights = MIXES[mix]
    items = ", ".join(
        f"{{name: {source}, shards: [{root}/{folder}/{source}], weight: {weight}}}"
        for source, weight in weights.items()
    )
    val = f"{{name: val, shards: [{root}/{folder}/val], weight: 1.0}}" if validation else ""
    return [f"data.sources=[{items}]", f"data.validation=[{val}]"]


@dataclass(frozen=True)
class Case:
    name: str
    experiment: str
    kind: str  # "failure" | "healthy"
    what: str
    onset: int | None = None
    gradual: bool = False
    seed: int = 0
    mix: str | None = None  # a healthy mix other than the experiment's own
    validation: bool = True  # the mix's held-out documents as data.validation (and probe rows)
    resume_at: int | None = None  # killed (SIGKILL) after this step, then resumed by a rerun
    overrides: tuple[str, ...] = field(default_factory=tuple)
    control: str = "healthy-debug-0"  # the healthy run its outcome is compared with
    same_data: bool = False  # the control reads the same data: its loss is a reference too


CASES_FILE = Path(__file__).resolve().parent / "cases.yaml"


def load_cases(path: Path = CASES_FILE) -> tuple[Case, ...]:
    """The cases of ``path`` (one flow mapping of ``Case``'s fields a line), in file order."""
    rows = yaml.safe_load(path.read_text())
    try:
        return tuple(Case(**{**row, "overrides": tuple(row.get("overrides", ()))}) for row in rows)
    except TypeError as error:  # a field Case does not have, or a required one missing
        raise ValueError(f"{path}: {error}") from None


CASES = load_cases()

# Every action set to log: the same run, with the monitors watching but never acting. The
# skip-step gate drops spiking updates by itself (optim.skip_step), so it is switched off too
# (a non-finite step is still skipped: there is nothing else to do with it).
LOG_ONLY = ("optim.skip_step.enabled=false",) + tuple(
    f"monitor.{name}.action=log" for name in DETECTORS
)
ACTING = ("skip", "rollback", "halt")  # the actions that change a run
