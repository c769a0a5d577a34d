"""When does a failure become visible in the loss, and which alarms came before it (lead time)?

The *loss rule* (docs/monitors.md, "Measured on real instabilities", says why these settings) is
an objective stand-in for "a person looking at the loss curve would see it": the first step, from
``BURN_IN`` on, at which the total loss or a content modality's loss, smoothed by a token-weighted
EMA, stands ``RISE`` above its own running minimum, or the first non-finite loss (the total's
or a content modality's). A failure that shows as a stall never leaves its own minimum:
``loss_above_control`` compares with a healthy run on the same data instead. An alarm's **lead time** is the visible step minus the alarm's step.
The rule reads a run's *first* pass (until a rollback relogs steps), the trajectory on which the
trouble happened; ``earlyfuse-report`` reads, when that shows nothing, the pass the run went on
with too. ``earlyfuse-report`` and ``tools/monitor_eval/instability.py`` both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CONTENT = ("text", "code", "image", "video")
RISE, ALPHA, BURN_IN = 0.15, 0.05, 20  # the loss rule's settings (above)


@dataclass(frozen=True)
class Visible:
    step: int
    series: str  # "total" or a modality, or "non-finite"
    level: float  # the smoothed loss at that step (NaN for non-finite)
    minimum: float  # its running minimum


def first_pass(records: list[dict]) -> list[dict]:
    """The records of the first trajectory: in file order, up to the first step that goes back."""
    out, last = [], -1
    for record in records:  # load_run keeps only records with an integer step
        if record["step"] <= last:
            break
        out.append(record)
        last = record["step"]
    return out


def loss_visible(records: list[dict], restarts: list[int] | None = None) -> Visible | None:
    """The first step at which the loss rule holds on ``records`` (one trajectory, in step order);
    None when the loss never shows a failure. At each of the ``restarts`` (steps from which a
    resume changed the data mix) the levels start again, as the monitors' do: a total loss that
    rises because the mix turned to a harder source is no failure."""
    sums: dict[str, list[float]] = {}  # series -> [EMA of CE x tokens, EMA of tokens]
    lows: dict[str, float] = {}
    pending, start = sorted(restarts or []), 0
    for record in records:
        step = record["step"]
        if pending and step > pending[0]:
            while pending and step > pending[0]:
                start = pending.pop(0)
            sums.clear()
            lows.clear()
        if _non_finite(record):
            return Visible(step, "non-finite", math.nan, math.nan)
        for name, level in _update(sums, record).items():
            if step - start < BURN_IN:
                continue
            low = lows.get(name)
            if low is not None and level > (1 + RISE) * low:
                return Visible(step, name, level, low)
            lows[name] = level if low is None else min(low, level)
    return None


def _non_finite(record: dict) -> bool:
    """The total loss, or a content modality's loss over tokens it had, is NaN or infinite."""
    losses = [record.get("train/loss")]
    losses += [record.get(f"loss/{m}") for m in CONTENT if record.get(f"tokens/{m}")]
    return any(isinstance(v, (int, float)) and not math.isfinite(v) for v in losses)


def _smoothed(records: list[dict]) -> dict[int, dict[str, float]]:
    """step -> {series: token-weighted EMA of its loss} (series: total and content modalities)."""
    sums: dict[str, list[float]] = {}
    out: dict[int, dict[str, float]] = {}
    for record in records:
        _update(sums, record)
        out[record["step"]] = {name: acc[0] / acc[1] for name, acc in sums.items()}
    return out


def _update(sums: dict[str, list[float]], record: dict) -> dict[str, float]:
    """Fold one metrics record into the token-weighted EMAs: the finite total loss (weight 1) and
    each content modality's loss with the tokens it was measured on; the updated levels."""
    observed = {}
    loss = record.get("train/loss")
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        observed["total"] = (float(loss), 1.0)
    for modality in CONTENT:
        tokens = record.get(f"tokens/{modality}") or 0.0
        mean_ce = record.get(f"loss/{modality}")
        if tokens and isinstance(mean_ce, (int, float)) and math.isfinite(mean_ce):
            observed[modality] = (float(mean_ce), float(tokens))
    levels = {}
    for name, (mean_ce, tokens) in observed.items():
        acc = sums.setdefault(name, [mean_ce * tokens, tokens])
        acc[0] = (1 - ALPHA) * acc[0] + ALPHA * mean_ce * tokens
        acc[1] = (1 - ALPHA) * acc[1] + ALPHA * tokens
        levels[name] = acc[0] / acc[1]
    return levels


def loss_above_control(records: list[dict], control: list[dict]) -> Visible | None:
    """The first step at which the total or a content modality's smoothed loss stands ``RISE``
    above the same series of a healthy run on the same data at the same step (a failure that
    shows as a stall rather than a rise never leaves its own minimum); None if never."""
    ref = _smoothed(control)
    for step, levels in _smoothed(records).items():
        if step < BURN_IN or step not in ref:
            continue
        for name, level in levels.items():
            base = ref[step].get(name)
            if base and level > (1 + RISE) * base:
                return Visible(step, name, level, base)
    return None


def lead_time(alarm_step: int, visible: Visible | None) -> int | None:
    """Steps by which an alarm preceded the loss rule (negative: it came after); None when the
    loss never showed the failure."""
    return None if visible is None else visible.step - alarm_step
