"""The drawing helpers every report panel shares: the colours, the debiased EMA, a train curve
raw and smoothed, evaluation markers, non-finite marks, the clipped y range and the alarm lines.
Separate from ``panels.py`` (which panels a run gets and what each draws) so that a new panel is
written against these few helpers, and the page (``page.py``) can reuse the colours, the EMA
and the number format without the panel catalogue.

Conventions every panel follows:
- one colour per modality everywhere (text blue, code green, image orange, video red,
  structure brown; the total in black);
- a train series is drawn raw (faint) with its EMA on top (``smooth``, debiased as
  TensorBoard does, over the steps where the series is present; 0 draws the raw values only);
- evaluation values are markers; the values of ``final.json`` are stars at the last step;
- every alarm is a dashed vertical line coloured by its action and labelled ``A<i>`` (the row of
  the alarms table), with a marker on its modality's curve where the panel draws one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib.transforms import blended_transform_factory

from tools.report.run import RunData, Series, alarm_step

MODALITY_COLOR = {
    "text": "#1f77b4",
    "code": "#2ca02c",
    "image": "#ff7f0e",
    "video": "#d62728",
    "structure": "#8c564b",
    "total": "#000000",
}
EXTRA_COLORS = ["#9467bd", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f"]
ACTION_COLOR = {
    "log": "#8a8a8a",
    "warn": "#d4a017",
    "skip": "#e377c2",
    "rollback": "#9467bd",
    "halt": "#000000",
}
LABEL_ALARMS_UP_TO = 40  # past this many alarms, lines only: labels would overlap


def color_of(name: str, i: int = 0) -> str:
    return MODALITY_COLOR.get(name, EXTRA_COLORS[i % len(EXTRA_COLORS)])


def ema(values: np.ndarray, factor: float) -> np.ndarray:
    """Debiased exponential moving average; non-finite values are skipped (they keep the last
    smoothed value), so a NaN step does not erase the curve after it."""
    out = np.full(values.shape, np.nan)
    if factor <= 0:
        return values.astype(float).copy()
    acc = weight = 0.0
    for i, value in enumerate(values.tolist()):
        if math.isfinite(value):
            acc = factor * acc + (1 - factor) * value
            weight = factor * weight + (1 - factor)
        if weight > 0:
            out[i] = acc / weight
    return out


@dataclass
class Ctx:
    run: RunData
    smooth: float
    xlim: tuple[float, float]


# --- drawing helpers -------------------------------------------------------------------------------
def train_line(
    ax, s: Series, ctx: Ctx, label: str, color: str, scale: float = 1.0, lw: float = 1.6
):
    """Raw values faint, EMA solid; returns the curve drawn on top."""
    steps, values = s.steps, s.values * scale
    if ctx.smooth > 0:
        ax.plot(steps, values, color=color, alpha=0.22, lw=0.8)
        values = ema(values, ctx.smooth)
    ax.plot(
        steps,
        values,
        color=color,
        lw=lw,
        label=label,
        marker="o" if len(steps) <= 12 else None,
        ms=3,
    )
    return steps, values


def robust_ylim(ax, arrays: list[np.ndarray]) -> None:
    """Keep a few huge spikes from flattening the whole curve: clip the y range when the maximum
    is far beyond the bulk (the title says so), otherwise leave matplotlib's limits."""
    vals = (
        np.concatenate([array[np.isfinite(array)] for array in arrays]) if arrays else np.array([])
    )
    if vals.size < 20:
        return
    low, p99 = float(vals.min()), float(np.percentile(vals, 99))
    if vals.max() > p99 + 3 * (p99 - low) and p99 > low:
        ax.set_ylim(low - 0.05 * (p99 - low), p99 + 0.6 * (p99 - low))
        ax.set_title(ax.get_title() + "  [y clipped: spikes above]", fontsize=10)


def nonfinite_marks(ax, s: Series, label: str, color: str = "#b00020") -> None:
    bad = ~np.isfinite(s.values)
    if bad.any():
        blend = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter(
            s.steps[bad],
            np.full(bad.sum(), 0.97),
            transform=blend,
            marker="x",
            color=color,
            s=30,
            zorder=5,
            label=f"{label} NaN/inf ({int(bad.sum())})",
            clip_on=False,
        )


def eval_points(
    ax, run: RunData, key: str, label: str, color: str, marker: str = "o", scale: float = 1.0
):
    """Evaluation values as markers joined by a thin line that runs on to final.json's value,
    drawn as a star at the last step (the final evaluation is not in metrics.jsonl)."""
    steps, values = np.array([], dtype=np.int64), np.array([])
    series = run.series.get(key)
    if series is not None:
        finite = np.isfinite(series.values)
        steps, values = series.steps[finite], series.values[finite] * scale
    value = run.final.get(key)
    final = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(value, (int, float)) and final:
        final_step = run.total_steps or run.last_step
        keep = steps != final_step
        steps, values = np.append(steps[keep], final_step), np.append(values[keep], value * scale)
    if not len(steps):
        return None
    num_marked = len(steps) - final
    ax.plot(
        steps,
        values,
        lw=0.9,
        color=color,
        marker=marker,
        ms=5,
        markevery=list(range(num_marked)),
        label=label,
    )
    if final:
        ax.plot(
            steps[-1:], values[-1:], marker="*", ms=11, color=color, ls="none", mec="black", mew=0.5
        )
        ax.has_final_star = True  # render() adds one legend entry saying what the stars are
    return steps, values


def draw_alarms(ax, ctx: Ctx, curves: dict) -> None:
    """One collection of lines (and one of markers) per action, so thousands of alarms stay cheap."""
    blend = blended_transform_factory(ax.transData, ax.transAxes)
    by_action: dict[str, list[tuple[int, int, dict]]] = {}
    for i, alarm in enumerate(ctx.run.alarms, 1):
        step = alarm_step(alarm)
        if step is not None:
            by_action.setdefault(str(alarm.get("action", "log")), []).append((i, step, alarm))
    dense = len(ctx.run.alarms) > LABEL_ALARMS_UP_TO  # then thin faint lines, no labels or markers
    for action, items in by_action.items():
        color = ACTION_COLOR.get(action, "#555555")
        steps = [step for _, step, _ in items]
        ax.vlines(
            steps,
            0,
            1,
            transform=blend,
            colors=color,
            linestyles="--",
            alpha=0.35 if dense else 0.85,
            zorder=1,
            linewidth=(1.3 if action in ("rollback", "halt") else 1.0) * (0.6 if dense else 1),
            label=f"alarm: {action} ({len(items)})" if dense else f"alarm: {action}",
        )
        if dense:
            continue
        for i, step, _ in items:
            ax.text(
                step,
                1.01,
                f"A{i}",
                transform=blend,
                rotation=90,
                fontsize=7,
                color=color,
                ha="center",
                va="bottom",
                clip_on=False,
            )
        marker_steps, marker_values = [], []
        for _, step, alarm in items:
            curve = curves.get(alarm.get("modality") or "total")
            if curve is not None and np.isfinite(curve[1]).any():
                finite = np.isfinite(curve[1])
                marker_steps.append(step)
                marker_values.append(np.interp(step, curve[0][finite], curve[1][finite]))
        if marker_steps:
            ax.plot(
                marker_steps,
                marker_values,
                marker="D",
                ms=6,
                color=color,
                mec="black",
                mew=0.6,
                zorder=6,
                ls="none",
            )


def human(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"
