"""The figures of a report: which panels a run gets, in reading order, what each draws
(docs/report.md, "What it draws"), and each panel and the text header of report.png as PNG bytes.
matplotlib draws on bare ``Figure`` objects with the Agg canvas (no pyplot, nothing global), every
panel the same size so that report.png is a clean grid.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ticker import FuncFormatter, MaxNLocator
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
# Names that are no modality (data sources, a monitor's other names) in turn, one colour each
EXTRA_COLORS = ["#9467bd", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#aec7e8", "#98df8a"]
EXTRA_COLORS += ["#ffbb78", "#ff9896", "#c5b0d5", "#c49c94", "#dbdb8d"]
ACTION_COLOR = {
    "log": "#8a8a8a",
    "warn": "#d4a017",
    "skip": "#e377c2",
    "rollback": "#9467bd",
    "halt": "#000000",
}
LABEL_ALARMS_UP_TO = 40  # past this many alarms, lines only: labels would overlap


def ema(values: np.ndarray, factor: float, steps: np.ndarray | None = None) -> np.ndarray:
    """Debiased EMA, ``factor`` in (0, 1) per step; a NaN/inf keeps the last value (the curve
    goes on). With the ``steps`` the values were logged at, every k steps (the median gap: a
    probe, a modality absent from most batches), the factor is ``factor**k``: one smoothing for
    every curve and figure of a report."""
    if steps is not None and len(steps) > 1:
        factor **= float(np.median(np.diff(steps)))
    out = np.full(values.shape, np.nan)
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
    colors: dict[str, str] = field(default_factory=dict)  # name -> colour, in every panel

    def color(self, name: str) -> str:
        """A modality's own colour, else the next free one from the first panel drawing it."""
        if name not in MODALITY_COLOR and name not in self.colors:
            self.colors[name] = EXTRA_COLORS[len(self.colors) % len(EXTRA_COLORS)]
        return MODALITY_COLOR.get(name) or self.colors[name]


# --- drawing helpers -------------------------------------------------------------------------------
def train_line(
    ax, s: Series, ctx: Ctx, label: str, color: str, scale: float = 1.0, lw: float = 1.6
):
    """Raw values faint, EMA solid (per step: a probe every k steps gets factor**k); returns it."""
    steps, values = s.steps, s.values * scale
    if ctx.smooth > 0:
        ax.plot(steps, values, color=color, alpha=0.22, lw=0.8)
        values = ema(values, ctx.smooth, steps)
    marker = "o" if len(steps) <= 12 else None
    ax.plot(steps, values, color=color, lw=lw, label=label, marker=marker, ms=3)
    replaced_line(ax, ctx, s.key, color, scale)
    return steps, values


def replaced(ctx: Ctx, key: str) -> dict[int, float]:
    """step -> value of ``key`` in the steps a rollback (or a resume) replaced or dropped."""
    kept = ctx.run.records
    gone = [(r["step"], r.get(key)) for r in ctx.run.first_pass if r is not kept.get(r["step"])]
    return {step: value for step, value in gone if isinstance(value, (int, float))}


def replaced_line(ax, ctx: Ctx, key: str, color: str, scale: float = 1.0) -> None:
    """The first pass's values that a rollback (or a resume) replaced, dotted: the trouble its
    alarms saw, and what caused it (an lr too high), stay on the panel."""
    if gone := replaced(ctx, key):
        ax.plot(list(gone), [value * scale for value in gone.values()], color=color, ls=":", lw=1.0)


def robust_ylim(ax, arrays: list[np.ndarray]) -> None:
    """Clip the y range when the maximum is far beyond the bulk (the title says so): a few huge
    spikes do not flatten the whole curve."""
    vals = np.concatenate([array[np.isfinite(array)] for array in arrays] or [np.array([])])
    if vals.size < 20:
        return
    low, p99 = float(vals.min()), float(np.percentile(vals, 99))
    if vals.max() > p99 + 3 * (p99 - low) and p99 > low:
        ax.set_ylim(low - 0.05 * (p99 - low), p99 + 0.6 * (p99 - low))
        ax.set_title(ax.get_title() + "  [y clipped: spikes above]", fontsize=10)


def nonfinite_marks(ax, series: Series, label: str, top: float = 0.97, **style) -> None:
    """A step whose value is NaN/inf (or, from draw_grad, missing) at the top edge: the curve has
    no point there to put it at."""
    bad = ~np.isfinite(series.values)
    if bad.any():
        style = {"marker": "x", "s": 30, "label": f"{label} NaN/inf ({int(bad.sum())})", **style}
        blend = blended_transform_factory(ax.transData, ax.transAxes)
        top_edge = np.full(bad.sum(), top)
        ax.scatter(series.steps[bad], top_edge, transform=blend, clip_on=False, **RED, **style)


RED: dict[str, Any] = {"color": "#b00020", "zorder": 5}  # a non-finite or skipped step
MARK: dict[str, Any] = {"ls": "none", "mec": "black", "mew": 0.5}  # a marker alone, outlined
STAR: dict[str, Any] = {"marker": "*", **MARK}  # final.json's values


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
    value = run.final.get(key, math.nan)
    final = type(value) in (int, float) and math.isfinite(value)  # not a bool
    if final:
        keep, last = steps != run.last_step, run.last_step
        steps, values = np.append(steps[keep], last), np.append(values[keep], value * scale)
    if not len(steps):
        return None
    marked = list(range(len(steps) - final))  # the star marks final.json's
    ax.plot(steps, values, lw=0.9, color=color, marker=marker, ms=5, markevery=marked, label=label)
    if final:
        ax.plot(steps[-1:], values[-1:], ms=11, color=color, **STAR)
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
    labels: list[tuple[int, int, str]] = []  # (step, number, colour) of each alarm labelled
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
        labels += [(step, i, color) for i, step, _ in items]
        marker_steps, marker_values = [], []
        for _, step, alarm in items:
            curve = curves.get(alarm.get("modality") or "total", (np.array([]), np.array([])))
            finite = np.isfinite(curve[1])  # marked where the curve is drawn, not past its ends
            if finite.any() and curve[0][finite][0] <= step <= curve[0][finite][-1]:
                marker_steps.append(step)
                marker_values.append(np.interp(step, curve[0][finite], curve[1][finite]))
        if marker_steps:
            ax.plot(marker_steps, marker_values, marker="D", ms=6, color=color, zorder=6, **MARK)
    alarm_labels(ax, ctx, labels)


def alarm_labels(ax, ctx: Ctx, alarms: list[tuple[int, int, str]]) -> None:
    """``A<i>`` over each alarm's line; alarms whose labels would overlap share one (``A3-A5``,
    or ``A3,A7`` when not numbered in turn), centred over them."""
    renderer, font = FigureCanvasAgg(Figure(dpi=DPI)).get_renderer(), _font(7, "normal")
    per_px = (ctx.xlim[1] - ctx.xlim[0]) / (PANEL_SIZE[0] * AXES[2] * DPI)  # steps per pixel

    def text(group: list) -> str:
        nums = sorted(i for _, i, _ in group)
        in_turn = len(nums) > 1 and nums[-1] - nums[0] == len(nums) - 1
        return f"A{nums[0]}-A{nums[-1]}" if in_turn else ",".join(f"A{i}" for i in nums)

    def span(group: list) -> tuple[float, float]:  # the label's ends, in steps, 2 px apart
        half = (renderer.get_text_width_height_descent(text(group), font, False)[0] + 2) / 2
        mid = (group[0][0] + group[-1][0]) / 2
        return mid - half * per_px, mid + half * per_px

    groups: list[list[tuple[int, int, str]]] = []
    for alarm in sorted(alarms):
        groups.append([alarm])
        while len(groups) > 1 and span(groups[-2])[1] > span(groups[-1])[0]:
            groups[-2:] = [groups[-2] + groups[-1]]  # a wider label may reach the one before
    blend = blended_transform_factory(ax.transData, ax.transAxes)
    for group in groups:
        colors = {color for *_, color in group}
        color = colors.pop() if len(colors) == 1 else "#555555"  # of several actions
        x, style = (group[0][0] + group[-1][0]) / 2, {"ha": "center", "va": "bottom"}
        ax.text(x, 1.01, text(group), transform=blend, fontsize=7, color=color, **style)


def human(x: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


UNIT_NAME = {"lm": "tokens", "vtok": "images"}
MONITOR_TITLES = {
    "logz": "log Z per modality (softmax normaliser)",
    "hidden_norm": "final hidden-state norm per modality",
    "logit_gap": "logit gap per modality (code slice minus text slice)",
}


@dataclass
class Panel:
    key: str  # a short id (the HTML anchor)
    title: str
    ylabel: str
    draw: Callable  # draw(ax, ctx) -> {curve name: (x, y)} for the alarm markers
    note: str = ""  # a caption for the HTML page
    xlabel: str = "step"  # any other: the panel draws its own x axis (no step axis, no alarms)
    shown: bool = True  # the run logged what the panel draws


# --- the panels ------------------------------------------------------------------------------------
def same(a: Series, b: Series | None) -> bool:
    return (
        b is not None
        and np.array_equal(a.steps, b.steps)
        and np.allclose(a.values, b.values, equal_nan=True)
    )


def per_modality(
    prefix: str, *, total: str | None = None, hline: float | None = None, clip: bool = False
):
    """A panel drawing ``prefix<m>`` for every modality present, then any other ``prefix<name>``
    (a monitor's per-modality signals), and ``total`` in black."""

    def draw(ax, ctx: Ctx):
        run, curves, arrays = ctx.run, {}, []
        mods = run.modalities() + [key for key in run.keys(prefix) if key not in run.modalities()]
        tot = total if total in run.series else None
        if tot and len(mods) == 1 and same(run.series[tot], run.series.get(prefix + mods[0])):
            tot = None  # one modality whose loss is the total (a vtok run): one line, not two
        if tot:  # the total loss, what an alarm without a modality is about; else a signal's
            name = "total" if tot == "train/loss" else tot
            total_series = run.series[tot]
            curves[name] = train_line(ax, total_series, ctx, name, MODALITY_COLOR["total"], lw=2.0)
            nonfinite_marks(ax, total_series, name)
            arrays.append(total_series.values)
        for modality in mods:
            series = run.series.get(prefix + modality)
            if series is None or not np.isfinite(series.values).any():
                continue
            curves[modality] = train_line(ax, series, ctx, modality, ctx.color(modality))
            arrays.append(series.values)
        if hline is not None:
            ax.axhline(hline, color="black", ls=":", lw=1.2, label=f"chance ({hline:g})")
        if clip:
            robust_ylim(ax, arrays)
        return curves

    return draw


def draw_val(ax, ctx: Ctx):
    run, curves = ctx.run, {}
    for modality in run.modalities():
        points = eval_points(ax, run, f"val/loss/{modality}", modality, ctx.color(modality))
        if points is not None:
            curves[modality] = points
        series = run.series.get(f"loss/{modality}")
        if series is not None and ctx.smooth > 0 and np.isfinite(series.values).any():
            ax.plot(
                series.steps,
                ema(series.values, ctx.smooth, series.steps),
                color=ctx.color(modality),
                lw=0.9,
                ls="--",
                alpha=0.5,
            )
    points = eval_points(ax, run, "val/loss", "all", "#000000", marker="s")
    if points is not None:
        curves["total"] = points
    ax.plot([], [], color="#777777", ls="--", lw=0.9, label="train EMA (ref.)")
    return curves


def draw_mix(ax, ctx: Ctx):
    run = ctx.run
    names = run.sources()
    grid = np.unique(np.concatenate([run.series[f"mix/{name}"].steps for name in names]))
    curves = []
    for name in names:
        series = run.series[f"mix/{name}"]
        curve = np.interp(grid, series.steps, np.nan_to_num(series.values))
        curves.append(ema(curve, ctx.smooth, grid) if ctx.smooth > 0 else curve)
    stack = np.array(curves)
    stack = stack / np.maximum(stack.sum(axis=0, keepdims=True), 1e-12)
    if len(grid) == 1:  # one step: a band one step wide (a stack over one x has no width)
        grid, stack = np.array([grid[0] - 0.5, grid[0] + 0.5]), np.repeat(stack, 2, axis=1)
    ax.stackplot(grid, stack, labels=names, colors=[ctx.color(n) for n in names], alpha=0.85)
    # Each pass's cumulative config weights over the steps it trained (a resume may change them):
    # the pass of a step is the last to go on from an earlier step; NaN where no config is known
    starts = [start for start, _ in run.target_mixes]
    weights = [[mix.get(n, 0.0) if mix else np.nan for n in names] for _, mix in run.target_mixes]
    at = np.cumsum(weights, axis=1)[np.maximum(np.searchsorted(starts, grid) - 1, 0)]
    for j in range(len(names) - 1 if np.isfinite(at).any() else 0):
        label = "target (config)" if j == 0 else None
        ax.plot(grid, at[:, j], color="black", ls="--", lw=0.8, drawstyle="steps-mid", label=label)
    ax.set_ylim(0, 1)
    return {}


def draw_tokens(ax, ctx: Ctx):
    run, curves = ctx.run, {}
    for modality in run.keys("tokens/"):
        series = run.series[f"tokens/{modality}"]
        if not (np.nan_to_num(series.values) > 0).any():
            continue
        kept, spent = (human(x) for x in run.spent(f"tokens/{modality}"))  # replaced steps too
        # two lines where steps were replaced: one would run past the figure's right edge
        said = f"\n({kept} kept, {spent} in all)" if run.replaced else f" ({kept} total)"
        curves[modality] = train_line(ax, series, ctx, f"{modality}{said}", ctx.color(modality))
    return curves


def draw_grad(ax, ctx: Ctx):
    run = ctx.run
    series = run.series["optim/grad_norm"]
    curve = train_line(ax, series, ctx, "grad norm", "#333333")
    positive = np.isfinite(series.values) & (series.values > 0)
    if positive.sum() > 1 and series.values[positive].max() / series.values[positive].min() > 30:
        ax.set_yscale("log")
    nonfinite_marks(ax, series, "grad norm")
    skipped = run.series.get("optim/skipped")
    steps = skipped.steps[np.nan_to_num(skipped.values) > 0] if skipped else np.array([], int)
    at = dict(zip(series.steps.tolist(), series.values.tolist()))
    norms = np.array([at.get(step, np.nan) for step in steps.tolist()])
    on = np.isfinite(norms)  # on the curve where it has a value, else at the top as a NaN is
    if on.any():
        ax.scatter(
            steps[on], norms[on], marker="v", s=40, label=f"skipped step ({on.sum()})", **RED
        )
    nonfinite_marks(ax, Series(steps, norms), "skipped, grad", 0.9, marker="v", s=40)  # under its ✕
    # Steps skipped in a pass a rollback replaced: hollow, on the dotted curve
    gone, norm_at = replaced(ctx, "optim/skipped"), replaced(ctx, "optim/grad_norm")
    if marks := [(step, norm_at[step]) for step, n in gone.items() if n > 0 and step in norm_at]:
        ax.scatter(
            *zip(*marks),
            marker="v",
            s=40,
            facecolors="none",
            edgecolors=RED["color"],
            zorder=RED["zorder"],
            label=f"skipped, replaced pass ({len(marks)})",
        )
    return {"grad norm": curve}


def simple(run: RunData, key: str, title: str, ylabel: str, curves, *, scale=1.0, note=""):
    """A panel of train curves ``(key, label, color)`` and evaluation curves ``(key, label, color,
    marker)``, shown when one of its keys has a value (final.json's count)."""

    def draw(ax, ctx: Ctx):
        drawn: dict[str, object] = {}
        for curve_key, label, color, *marker in curves:
            if marker:
                eval_points(ax, ctx.run, curve_key, label, color, marker[0], scale)
            elif ctx.run.has(curve_key):
                series = ctx.run.series[curve_key]
                drawn[label] = train_line(ax, series, ctx, label, color, scale)  # no alarm's
        return drawn

    shown = any(run.has(curve[0]) or curve[0] in run.final for curve in curves)
    return Panel(key, title, ylabel, draw, note, shown=shown)


def draw_lr(ax, ctx: Ctx):
    series = ctx.run.series["optim/lr"]
    ax.plot(series.steps, series.values, color="#333333", lw=1.6, label="lr")
    replaced_line(ax, ctx, "optim/lr", "#333333")
    gone, kept = replaced(ctx, "optim/lr").values(), series.values[np.isfinite(series.values)]
    if gone and len(kept) and max(gone) > 30 * kept.max():  # a replaced blow-up: the schedule
        ax.set_yscale("log")  # it would flatten stays readable (warmup alone keeps a linear axis)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # no offset text
    return {}


def monitor_signals(run: RunData) -> list[str]:
    """``monitor/<signal>/<m>`` and ``monitor/<signal>`` groups, the known ones first."""
    signals = {
        key.split("/")[1] for key in run.series if key.startswith("monitor/") and run.has(key)
    }
    return [signal for signal in MONITOR_TITLES if signal in signals] + sorted(
        signals - set(MONITOR_TITLES)
    )


def draw_position(ax, ctx: Ctx):
    """The held-out CE per position bucket and modality (earlyfuse-eval --position-loss), at
    each bucket's middle on a log axis: falling to the right when the context helps."""
    pos = ctx.run.heldout_eval.get("position_loss") or {}
    middles = np.array([(start + end) / 2 for start, end in pos.get("buckets", [])])
    for name, fig in (pos.get("modalities") or {}).items():
        values = np.array([c["ce"] for c in fig["buckets"]], dtype=float)  # None: NaN
        ax.plot(middles, values, marker="o", ms=4, lw=1.6, color=ctx.color(name), label=name)
    if len(middles):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
    return {}


def panels_for(run: RunData) -> list[Panel]:
    """The panels this run has data for, in reading order."""
    has = run.has
    unit = UNIT_NAME.get(run.task, "units")
    nats = "reconstruction loss (L1/L2)" if run.task == "vtok" else "cross-entropy (nats)"
    position = run.heldout_eval.get("position_loss") or {}
    util: list[tuple] = [
        ("throughput/mfu", "MFU", "#1f77b4"),
        ("throughput/data_wait", "data wait (share of step)", "#d62728"),
    ]
    psnr: list[tuple] = [
        ("vtok/psnr", "train", "#ff7f0e"),
        ("eval/psnr", "eval (held-out)", "#1f77b4", "o"),
        # the equal-bits baselines the run's warning compares with, under the same names
        ("eval/baseline_psnr", "mean-colour baseline", "#7f7f7f", "s"),
        ("eval/palette_psnr", "palette baseline", "#2ca02c", "D"),
    ]
    codes: list[tuple] = [
        ("vtok/code_fraction", "train batch", "#9467bd"),
        ("eval/code_fraction", "eval", "#17becf", "o"),
    ]
    panels = [
        Panel(
            "loss",
            "Train loss: total and per modality",
            nats,
            per_modality("loss/", total="train/loss", clip=True),
            shown=has("train/loss") or bool(run.keys("loss/")),
        ),
        Panel(
            "val",
            "Validation loss per modality",
            nats,
            draw_val,
            "Markers: each evaluation; stars: final.json; dashed: the train EMA for reference.",
            shown=any(key.startswith("val/loss") for key in [*run.series, *run.final]),
        ),
        Panel(
            "loss_norm",
            "Normalised CE per modality (CE / ln V)",
            "CE / ln V",
            per_modality("loss_norm/", hline=1.0),
            "1.0 is chance over the modality's own vocabulary range; near 1.0 late in a run is collapse.",
            shown=bool(run.keys("loss_norm/")),
        ),
        Panel(
            "mix",
            "Delivered mix by source (share of tokens)",
            "share",
            draw_mix,
            "Stacked shares of each step's tokens, EMA-smoothed; dashed: each pass's cumulative config weights.",
            shown=bool(run.keys("mix/")),
        ),
        Panel(
            "tokens",
            "Label tokens per step by modality",
            "tokens / step",
            draw_tokens,
            shown=bool(run.keys("tokens/")),
        ),
        Panel(
            "grad",
            "Gradient norm (skipped steps marked)",
            "global grad norm",
            draw_grad,
            shown=has("optim/grad_norm"),
        ),
        Panel("lr", "Learning rate", "lr", draw_lr, shown=has("optim/lr")),
        simple(
            run,
            "throughput",
            f"Throughput ({unit}/s)",
            f"{unit} / s",
            [("throughput/units_per_s", f"{unit}/s", "#333333")],
        ),
        simple(run, "util", "MFU and data wait", "% ", util, scale=100.0),
        *(
            Panel(
                f"monitor_{sig}",
                MONITOR_TITLES.get(sig, f"monitor/{sig}"),
                sig,
                per_modality(f"monitor/{sig}/", total=f"monitor/{sig}"),
            )
            for sig in monitor_signals(run)
        ),
        simple(
            run, "psnr", "Reconstruction PSNR against the equal-bits baselines", "PSNR (dB)", psnr
        ),
        simple(
            run,
            "ssim",
            "SSIM (eval, held-out crops)",
            "SSIM",
            [("eval/ssim", "SSIM", "#2ca02c", "o")],
        ),
        simple(
            run,
            "codes",
            "Visual code use (share of the codebook used)",
            "fraction of codes",
            codes,
            note="eval/code_perplexity is in the summary table.",
        ),
        simple(
            run,
            "recon",
            "Reconstruction error (train)",
            "mean error",
            [("vtok/l1", "L1", "#8c564b"), ("vtok/l2", "L2 (MSE)", "#e377c2")],
        ),
        Panel(
            "position",
            "Held-out loss by token position (earlyfuse-eval --position-loss)",
            nats,
            draw_position,
            "Mean CE per position bucket over the document stretches that cover the bucket, "
            "per modality of the predicted token: falling to the right when the context helps.",
            xlabel="position in the document (tokens)",
            shown=bool(position.get("buckets")),
        ),
    ]
    return [panel for panel in panels if panel.shown]


# --- PNG bytes ------------------------------------------------------------------------------------
PANEL_SIZE = (7.6, 3.5)  # inches; every panel the same, so that report.png is a clean grid
DPI = 100
MARGIN = 0.01  # of the header's width, left and right
AXES = (0.105, 0.14, 0.615, 0.74)  # a panel's axes in the figure: left, bottom, width, height


def x_limits(run: RunData) -> tuple[float, float]:
    steps = run.steps + [step for step in map(alarm_step, run.alarms) if step is not None]
    if not steps:
        return 0.0, 1.0
    low, high = min(steps), max(steps)
    pad = max(0.5, 0.02 * (high - low))
    return low - pad, high + pad


def render(panel: Panel, ctx: Ctx) -> bytes:
    """One panel as PNG bytes (no pyplot: a bare Figure on the Agg canvas, nothing global)."""
    buf = io.BytesIO()
    panel_figure(panel, ctx).savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def panel_figure(panel: Panel, ctx: Ctx) -> Figure:
    """One panel drawn on its own figure, with its title, alarms and legend."""
    fig = Figure(figsize=PANEL_SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes(AXES)
    ax.set_title(panel.title, fontsize=10, loc="left", pad=14 if ctx.run.alarms else 6)
    curves = panel.draw(ax, ctx) or {}
    if getattr(ax, "has_final_star", False):
        ax.plot([], [], ms=9, color="#bbbbbb", label="final.json", **STAR)
    if panel.xlabel == "step":
        draw_alarms(ax, ctx, curves)
        ax.set_xlim(*ctx.xlim)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    return fig


def _font(size: float, style: str) -> FontProperties:
    return FontProperties(
        size=size,
        weight="bold" if style == "bold" else "normal",
        family="monospace" if style == "mono" else "sans-serif",
    )


def wrap_lines(lines: list[tuple[str, float, str]], width_px: int) -> list[tuple[str, float, str]]:
    """The header's lines broken at spaces so that none is wider than the strip (measured with
    the renderer's own font metrics); a continuation is indented."""
    renderer = FigureCanvasAgg(Figure(dpi=DPI)).get_renderer()
    room = width_px * (1 - 2 * MARGIN)

    def width(text: str, font: FontProperties) -> float:
        return renderer.get_text_width_height_descent(text, font, ismath=False)[0]

    out = []
    for text, size, style in lines:
        font = _font(size, style)
        current = ""
        for word in text.split(" "):
            trial = f"{current} {word}" if current else word
            if current.strip() and width(trial, font) > room:
                out.append((current, size, style))
                current = "    " + word
            else:
                current = trial
        out.append((current, size, style))
    return out


def render_header(lines: list[tuple[str, float, str]], width_px: int) -> bytes:
    """The top strip of report.png: ``(text, fontsize, style: bold|normal|mono)`` lines, wrapped."""
    lines = wrap_lines(lines, width_px)
    height = 0.3 + sum(size for _, size, _ in lines) * 1.6 / 72
    fig = Figure(figsize=(width_px / DPI, height), dpi=DPI)
    FigureCanvasAgg(fig)
    top = 1 - 0.15 / height
    for text, size, style in lines:
        fig.text(MARGIN, top, text, va="top", fontproperties=_font(size, style))
        top -= size * 1.6 / 72 / height
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
