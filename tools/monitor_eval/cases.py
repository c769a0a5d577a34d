"""The instability suite's cases: each a real training run (``earlyfuse-train experiment=...``)
whose failure comes from its config or its data only (tools/monitor_eval/configs/experiment/instab_*.yaml).

``onset`` is the step the pathology starts by construction (the first x1.5 lr stage, the step
a source turns bad, the lr jump); ``gradual`` marks the failures the monitors should flag before
the loss shows them (logit growth, norm drift, competition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Controls the detectors were not tuned on: other presets, mixes, tokenizers, lengths, seeds.
    Case(
        "healthy-debug-preset-0",
        "debug",
        "healthy",
        "debug preset as is, code + text + scenes (trained visual tokenizer)",
        mix="code-text-scenes",
        validation=False,
        overrides=("train.steps=300",),
    ),
    Case(
        "healthy-debug-preset-1",
        "debug",
        "healthy",
        "debug preset as is, code + text + colour squares (trained visual tokenizer)",
        seed=1,
        mix="code-text-colours",
        validation=False,
        overrides=("train.steps=300",),
    ),
    Case(
        "healthy-debug-preset-whole",
        "debug",
        "healthy",
        "debug preset as is, code + text + scenes, long documents whole (not cut into pieces)",
        seed=2,
        mix="whole-code-text-scenes",
        validation=False,
        overrides=("train.steps=300",),
    ),
    Case(
        "healthy-demo-preset",
        "demo",
        "healthy",
        "demo preset as is (8 rows of 512), base mix, 100 steps",
        seed=4,
        mix="base",
        overrides=("train.steps=100",),
    ),
    Case(
        "healthy-text-only",
        "instab_healthy",
        "healthy",
        "text only, 200 steps",
        seed=5,
        mix="text-only",
        validation=False,
        overrides=("train.steps=200",),
    ),
    Case(
        "healthy-code-only",
        "instab_healthy",
        "healthy",
        "code only",
        seed=6,
        mix="code-only",
        validation=False,
    ),
    Case(
        "healthy-video-only",
        "instab_healthy",
        "healthy",
        "video clips only",
        seed=7,
        mix="video-only",
        validation=False,
    ),
    Case(
        "healthy-images-small",
        "instab_healthy",
        "healthy",
        "images 10 % of the mix (trained visual tokenizer)",
        seed=8,
        mix="images-small",
    ),
    Case(
        "healthy-trained-codes",
        "instab_healthy",
        "healthy",
        "base mix, images and clips from a trained visual tokenizer",
        seed=9,
        mix="trained-base",
    ),
    Case(
        "healthy-short-100",
        "instab_healthy",
        "healthy",
        "base mix, 100 steps",
        seed=10,
        overrides=("train.steps=100",),
    ),
    Case(
        "healthy-resumed",
        "instab_healthy",
        "healthy",
        "base mix, killed after step 150 and resumed",
        seed=11,
        resume_at=150,
    ),
)

# Every action set to log: the same run, with the monitors watching but never acting. The
# skip-step gate drops spiking updates by itself (optim.skip_step), so it is switched off too
# (a non-finite step is still skipped: there is nothing else to do with it).
LOG_ONLY = ("optim.skip_step.enabled=false",) + tuple(
    f"monitor.{name}.action=log" for name in DETECTORS
)
ACTING = ("skip", "rollback", "halt")  # the actions that change a run
