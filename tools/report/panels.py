"""The panels: which groups of signals a run gets a figure for, in reading order, and what each
figure draws (train loss, validation loss, normalised CE, the data mix, tokens, grad norm, lr,
throughput, the monitor signals and the visual tokenizer's PSNR/SSIM/code use). Each panel is
drawn only when the run logged its group, all on the same step axis with the alarms marked.
The shared helpers and colours are in ``draw.py``; turning a panel into PNG bytes is
``render.py``: this file is only the catalogue, so adding a panel touches nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib.ticker import FuncFormatter

from tools.report.draw import (
    MODALITY_COLOR,
    Ctx,
    color_of,
    ema,
    eval_points,
    human,
    nonfinite_marks,
    robust_ylim,
    train_line,
)
from tools.report.run import RunData, Series

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


# --- the panels ------------------------------------------------------------------------------------
def same(a: Series, b: Series | None) -> bool:
    return (
        b is not None
        and np.array_equal(a.steps, b.steps)
        and np.allclose(a.values, b.values, equal_nan=True)
    )


def per_modality(
    prefix: str,
    *,
    total: str | None = None,
    hline: float | None = None,
    clip: bool = False,
    scale: float = 1.0,
):
    """A panel drawing ``prefix<m>`` for every modality present, then any other ``prefix<name>``
    (a monitor's per-modality signals), and ``total`` in black."""

    def draw(ax, ctx: Ctx):
        run, curves, arrays = ctx.run, {}, []
        mods = run.modalities() + [key for key in run.keys(prefix) if key not in run.modalities()]
        tot = total if total in run.series else None
        if tot and len(mods) == 1 and same(run.series[tot], run.series.get(prefix + mods[0])):
            tot = None  # one modality whose loss is the total (a vtok run): one line, not two
        if tot:
            total_series = run.series[tot]
            curves["total"] = train_line(
                ax, total_series, ctx, "total", MODALITY_COLOR["total"], scale, lw=2.0
            )
            nonfinite_marks(ax, total_series, "total")
            arrays.append(total_series.values)
        for i, modality in enumerate(mods):
            series = run.series.get(prefix + modality)
            if series is None or not np.isfinite(series.values).any():
                continue
            curves[modality] = train_line(ax, series, ctx, modality, color_of(modality, i), scale)
            arrays.append(series.values * scale)
        if hline is not None:
            ax.axhline(hline, color="black", ls=":", lw=1.2, label=f"chance ({hline:g})")
        if clip:
            robust_ylim(ax, arrays)
        return curves

    return draw


def draw_val(ax, ctx: Ctx):
    run, curves = ctx.run, {}
    for i, modality in enumerate(run.modalities()):
        points = eval_points(ax, run, f"val/loss/{modality}", modality, color_of(modality, i))
        if points is not None:
            curves[modality] = points
        series = run.series.get(f"loss/{modality}")
        if series is not None and ctx.smooth > 0 and np.isfinite(series.values).any():
            ax.plot(
                series.steps,
                ema(series.values, ctx.smooth),
                color=color_of(modality, i),
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
    grid = np.array(
        sorted(set().union(*(run.series[f"mix/{name}"].steps.tolist() for name in names)))
    )
    curves = []
    for name in names:
        series = run.series[f"mix/{name}"]
        curve = (
            np.interp(grid, series.steps, np.nan_to_num(series.values))
            if len(series.steps)
            else np.zeros(len(grid))
        )
        curves.append(ema(curve, ctx.smooth) if ctx.smooth > 0 else curve)
    stack = np.array(curves)
    stack = stack / np.maximum(stack.sum(axis=0, keepdims=True), 1e-12)
    ax.stackplot(
        grid, stack, labels=names, colors=[f"C{i % 10}" for i in range(len(names))], alpha=0.85
    )
    cum = 0.0
    targets = [(name, run.target_mix[name]) for name in names if name in run.target_mix]
    for j, (_name, weight) in enumerate(targets[:-1]):
        cum += weight
        ax.axhline(cum, color="black", ls="--", lw=0.8, label="target (config)" if j == 0 else None)
    ax.set_ylim(0, 1)
    return {}


def draw_tokens(ax, ctx: Ctx):
    run, curves = ctx.run, {}
    for i, modality in enumerate(run.keys("tokens/")):
        series = run.series[f"tokens/{modality}"]
        if not (np.nan_to_num(series.values) > 0).any():
            continue
        total = float(np.nansum(series.values))
        curves[modality] = train_line(
            ax, series, ctx, f"{modality} ({human(total)} total)", color_of(modality, i)
        )
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
    if skipped is not None:
        idx = np.nonzero(np.nan_to_num(skipped.values) > 0)[0]
        if len(idx):
            steps = skipped.steps[idx]
            norms_at_skips = (
                np.interp(
                    steps,
                    series.steps[np.isfinite(series.values)],
                    series.values[np.isfinite(series.values)],
                )
                if np.isfinite(series.values).any()
                else np.zeros(len(steps))
            )
            ax.scatter(
                steps,
                norms_at_skips,
                marker="v",
                s=40,
                color="#b00020",
                zorder=5,
                label=f"skipped step ({len(idx)})",
            )
    return {"total": curve}


def draw_simple(keys: list[tuple[str, str, str]], scale: float = 1.0, eval_keys=()):
    """Train series ``(key, label, color)`` and evaluation series ``(key, label, color, marker)``."""

    def draw(ax, ctx: Ctx):
        curves: dict[str, object] = {}
        for key, label, color in keys:
            if ctx.run.has(key):
                curves.setdefault(
                    "total", train_line(ax, ctx.run.series[key], ctx, label, color, scale)
                )
        for key, label, color, marker in eval_keys:
            eval_points(ax, ctx.run, key, label, color, marker, scale)
        return curves

    return draw


def draw_lr(ax, ctx: Ctx):
    series = ctx.run.series["optim/lr"]
    ax.plot(series.steps, series.values, color="#333333", lw=1.6, label="lr")
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: f"{v:.3g}")
    )  # no offset text over the title
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
    for i, (name, fig) in enumerate((pos.get("modalities") or {}).items()):
        values = np.array(
            [np.nan if c["ce"] is None else c["ce"] for c in fig["buckets"]], dtype=float
        )
        ax.plot(middles, values, marker="o", ms=4, lw=1.6, color=color_of(name, i), label=name)
    if len(middles):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human(x)))
    return {}


def panels_for(run: RunData) -> list[Panel]:
    """The panels this run has data for, in reading order."""
    has = run.has
    unit = UNIT_NAME.get(run.task, "units")
    out = []
    if has("train/loss") or run.keys("loss/"):
        out.append(
            Panel(
                "loss",
                "Train loss: total and per modality",
                "cross-entropy (nats)",
                per_modality("loss/", total="train/loss", clip=True),
            )
        )
    if any(key.startswith("val/loss") for key in run.series) or any(
        key.startswith("val/loss") for key in run.final
    ):
        out.append(
            Panel(
                "val",
                "Validation loss per modality",
                "cross-entropy (nats)",
                draw_val,
                "Markers: each evaluation; stars: final.json; dashed: the train EMA for reference.",
            )
        )
    if run.keys("loss_norm/"):
        out.append(
            Panel(
                "loss_norm",
                "Normalised CE per modality (CE / ln V)",
                "CE / ln V",
                per_modality("loss_norm/", hline=1.0),
                "1.0 is chance over the modality's own vocabulary range; near 1.0 late in a run is collapse.",
            )
        )
    if run.keys("mix/"):
        out.append(
            Panel(
                "mix",
                "Delivered mix by source (share of tokens)",
                "share",
                draw_mix,
                "Stacked shares of each step's tokens, EMA-smoothed; dashed: cumulative config weights.",
            )
        )
    if run.keys("tokens/"):
        out.append(
            Panel("tokens", "Label tokens per step by modality", "tokens / step", draw_tokens)
        )
    if has("optim/grad_norm"):
        out.append(
            Panel("grad", "Gradient norm (skipped steps marked)", "global grad norm", draw_grad)
        )
    if has("optim/lr"):
        out.append(Panel("lr", "Learning rate", "lr", draw_lr))
    if has("throughput/units_per_s"):
        out.append(
            Panel(
                "throughput",
                f"Throughput ({unit}/s)",
                f"{unit} / s",
                draw_simple([("throughput/units_per_s", f"{unit}/s", "#333333")]),
            )
        )
    if has("throughput/mfu") or has("throughput/data_wait"):
        out.append(
            Panel(
                "util",
                "MFU and data wait",
                "% ",
                draw_simple(
                    [
                        ("throughput/mfu", "MFU", "#1f77b4"),
                        ("throughput/data_wait", "data wait (share of step)", "#d62728"),
                    ],
                    scale=100.0,
                ),
            )
        )
    for sig in monitor_signals(run):
        out.append(
            Panel(
                f"monitor_{sig}",
                MONITOR_TITLES.get(sig, f"monitor/{sig}"),
                sig,
                per_modality(f"monitor/{sig}/", total=f"monitor/{sig}"),
            )
        )
    if has("vtok/psnr") or has("eval/psnr") or "eval/psnr" in run.final:
        out.append(
            Panel(
                "psnr",
                "Reconstruction PSNR against the patch-mean baseline",
                "PSNR (dB)",
                draw_simple(
                    [("vtok/psnr", "train", "#ff7f0e")],
                    eval_keys=[
                        ("eval/psnr", "eval (held-out)", "#1f77b4", "o"),
                        ("eval/baseline_psnr", "baseline", "#7f7f7f", "s"),
                    ],
                ),
            )
        )
    if has("eval/ssim") or "eval/ssim" in run.final:
        out.append(
            Panel(
                "ssim",
                "SSIM (eval, held-out crops)",
                "SSIM",
                draw_simple([], eval_keys=[("eval/ssim", "SSIM", "#2ca02c", "o")]),
            )
        )
    if has("vtok/code_fraction") or has("eval/code_fraction") or "eval/code_fraction" in run.final:
        out.append(
            Panel(
                "codes",
                "Visual code use (share of the codebook used)",
                "fraction of codes",
                draw_simple(
                    [("vtok/code_fraction", "train batch", "#9467bd")],
                    eval_keys=[("eval/code_fraction", "eval", "#17becf", "o")],
                ),
                "eval/code_perplexity is in the summary table.",
            )
        )
    if has("vtok/l1") or has("vtok/l2"):
        out.append(
            Panel(
                "recon",
                "Reconstruction error (train)",
                "mean error",
                draw_simple([("vtok/l1", "L1", "#8c564b"), ("vtok/l2", "L2 (MSE)", "#e377c2")]),
            )
        )
    if (run.heldout_eval.get("position_loss") or {}).get("buckets"):
        out.append(
            Panel(
                "position",
                "Held-out loss by token position (earlyfuse-eval --position-loss)",
                "cross-entropy (nats)",
                draw_position,
                "Mean CE per position bucket over the document stretches that cover the bucket, "
                "per modality of the predicted token: falling to the right when the context helps.",
                xlabel="position in the document (tokens)",
            )
        )
    return out
