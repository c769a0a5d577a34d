"""One panel as PNG bytes, and the text header strip of report.png: the figure size and layout,
the step axis shared by every panel, the legend, and the alarms drawn over what the panel
drew. Separate from the panel catalogue (``panels.py``) because it is the one place that
knows about the figure and canvas (no pyplot: a bare ``Figure`` on the Agg canvas, nothing
global), so every panel comes out the same size and report.png is a clean grid.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.ticker import MaxNLocator

from tools.report.draw import Ctx, draw_alarms
from tools.report.panels import Panel
from tools.report.run import RunData, alarm_step

PANEL_SIZE = (7.6, 3.5)  # inches; every panel the same, so that report.png is a clean grid
DPI = 100
MARGIN = 0.01  # of the header's width, left and right


def x_limits(run: RunData) -> tuple[float, float]:
    steps = run.steps + [step for step in map(alarm_step, run.alarms) if step is not None]
    if run.final and run.total_steps:
        steps.append(run.total_steps)
    if not steps:
        return 0.0, 1.0
    low, high = min(steps), max(steps)
    pad = max(0.5, 0.02 * (high - low))
    return low - pad, high + pad


def render(panel: Panel, ctx: Ctx) -> bytes:
    """One panel as PNG bytes (no pyplot: a bare Figure on the Agg canvas, nothing global)."""
    fig = Figure(figsize=PANEL_SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.105, 0.14, 0.615, 0.74))
    ax.set_title(panel.title, fontsize=10, loc="left", pad=14 if ctx.run.alarms else 6)
    curves = panel.draw(ax, ctx) or {}
    if getattr(ax, "has_final_star", False):
        ax.plot(
            [],
            [],
            marker="*",
            ms=9,
            color="#bbbbbb",
            mec="black",
            mew=0.5,
            ls="none",
            label="final.json",
        )
    if panel.xlabel == "step":
        draw_alarms(ax, ctx, curves)
        ax.set_xlim(*ctx.xlim)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


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
    """The top strip of report.png: ``(text, fontsize, style)`` lines, style bold, normal or mono,
    wrapped to the strip's width."""
    lines = wrap_lines(lines, width_px)
    height = 0.3 + sum(size for _, size, _ in lines) * 1.6 / 72
    fig = Figure(figsize=(width_px / DPI, height), dpi=DPI)
    FigureCanvasAgg(fig)
    top = 1 - 0.15 / height
    for text, size, weight in lines:
        fig.text(
            MARGIN,
            top,
            text,
            fontsize=size,
            va="top",
            weight="bold" if weight == "bold" else "normal",
            family="monospace" if weight == "mono" else "sans-serif",
        )
        top -= size * 1.6 / 72 / height
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
