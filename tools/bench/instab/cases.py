"""The instability suite's cases: each a real training run (``earlyfuse-train experiment=...``)
whose failure comes from its config or its data only (configs/experiment/instab_*.yaml).

``onset`` is the step the pathology starts by construction (the first x1.5 lr stage, the step
a source turns bad, the lr jump); ``gradual`` marks the failures the monitors should flag before
the loss shows them (logit growth, norm drift, competition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from train.monitor.config import DETECTORS

# Healthy mixes: the same sources as instab_healthy, other weights.
_SOURCES = ("code", "text", "images", "clips", "docs", "colours", "colours_first")
MIXES = {
    "base": (0.25, 0.25, 0.2, 0.1, 0.1, 0.05, 0.05),
    "text-heavy": (0.15, 0.45, 0.15, 0.05, 0.1, 0.05, 0.05),
    "image-heavy": (0.15, 0.15, 0.35, 0.1, 0.1, 0.1, 0.05),
    "code-heavy": (0.45, 0.15, 0.15, 0.05, 0.1, 0.05, 0.05),
}


def mix_override(mix: str, root: str) -> str:
    """``data.sources=[...]`` for a named mix of the healthy sources under ``root``."""
    items = ", ".join(
        f"{{name: {source}, shards: [{root}/{source}], weight: {weight}}}"
        for source, weight in zip(_SOURCES, MIXES[mix])
    )
    return f"data.sources=[{items}]"


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
    overrides: tuple[str, ...] = field(default_factory=tuple)
    control: str = "healthy-debug-0"  # the healthy run its outcome is compared with
    same_data: bool = False  # the control reads the same data: its loss is a reference too


CASES = (
    Case(
        "attn-logit-growth",
        "instab_attn_logits",
        "failure",
        "no QK-norm, lr x1.5 every 20 steps from step 60",
        onset=60,
        gradual=True,
        same_data=True,
    ),
    Case(
        "logit-norm-drift",
        "instab_logit_drift",
        "failure",
        "no z-loss, lr x1.5 every 20 steps from step 60",
        onset=60,
        gradual=True,
        same_data=True,
    ),
    Case(
        "starvation",
        "instab_starvation",
        "failure",
        "mix shifts at ~step 120: text+code 70 % -> 20 % of tokens",
        onset=120,
        gradual=True,
    ),
    Case(
        "visual-code-collapse",
        "instab_code_collapse",
        "failure",
        "image codes near-constant from ~step 120",
        onset=120,
    ),
    Case(
        "garbage-ids",
        "instab_garbage",
        "failure",
        "code source turns into random ids at ~step 150",
        onset=150,
    ),
    Case(
        "lr-jump",
        "instab_lr_jump",
        "failure",
        "lr x100 for steps 100-119 (optim.lr_changes)",
        onset=100,
        same_data=True,
    ),
    Case("healthy-debug-0", "instab_healthy", "healthy", "debug recipe, base mix", seed=0),
    Case(
        "healthy-debug-1",
        "instab_healthy",
        "healthy",
        "debug recipe, text-heavy mix",
        seed=1,
        mix="text-heavy",
    ),
    Case(
        "healthy-debug-2",
        "instab_healthy",
        "healthy",
        "debug recipe, image-heavy mix",
        seed=2,
        mix="image-heavy",
    ),
    Case(
        "healthy-debug-3",
        "instab_healthy",
        "healthy",
        "debug recipe, code-heavy mix",
        seed=3,
        mix="code-heavy",
    ),
    Case("healthy-demo-0", "instab_demo", "healthy", "demo recipe, base mix", seed=0),
    Case(
        "healthy-demo-1",
        "instab_demo",
        "healthy",
        "demo recipe, text-heavy mix",
        seed=1,
        mix="text-heavy",
    ),
)

# Every action set to log: the same run, with the monitors watching but never acting. The
# skip-step gate drops spiking updates by itself (optim.skip_step), so it is switched off too
# (a non-finite step is still skipped: there is nothing else to do with it).
LOG_ONLY = ("optim.skip_step.enabled=false",) + tuple(
    f"monitor.{name}.action=log" for name in DETECTORS
)
ACTING = ("skip", "rollback", "halt")  # the actions that change a run
