"""The words and tables of a report: the summary facts (shared by report.png's header and the
HTML page) and the self-contained HTML page itself (PNG panels inlined as base64, inline CSS,
no script, nothing fetched)."""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import math
import string
import textwrap
from collections import Counter
from collections.abc import Set

import numpy as np

from tools.evaluate.table import format_eval
from tools.report.lead import Visible, lead_time
from tools.report.panels import ACTION_COLOR, ema, human
from tools.report.run import RunData, alarm_step, fmt
from train.names import METRICS_FILE


def status_of(run: RunData) -> str:
    if run.finished:
        return "finished"
    if run.halted:
        reason = str(run.halted.get("reason", ""))[:300]
        return reason if reason.startswith("halted") else f"halted by the monitors: {reason}"
    if unread := [
        f for f in ("final.json", "halted.json") if any(u.startswith(f) for u in run.unreadable)
    ]:
        return f"unknown ({' and '.join(unread)} there but unreadable: see the warning)"
    when = dt.datetime.fromtimestamp((run.run_dir / METRICS_FILE).stat().st_mtime, dt.timezone.utc)
    return f"running or stopped (no final.json of step {run.last_step}; metrics last written {when:%Y-%m-%d %H:%M:%S} UTC)"


def steps_text(run: RunData) -> str:
    if not run.config_read:  # nor train.steps, nor why a finished run ended where it did
        return f"{run.last_step:,} / ? (config.yaml missing or unreadable: the target is unknown)"
    if run.finished and run.last_step < (run.total_steps or math.inf):  # only data.mode=epoch
        return f"{run.last_step:,} (the data ended, data.mode=epoch)"
    if run.total_steps:
        return f"{run.last_step:,} / {run.total_steps:,} ({run.last_step / run.total_steps:.0%})"
    return f"{run.last_step:,} / ?"


def alarm_counts(run: RunData) -> str:
    if not run.alarms:
        return "no alarms"
    c = Counter(str(a.get("action", "?")) for a in run.alarms)
    return f"{len(run.alarms)} alarm(s): " + ", ".join(f"{n} {k}" for k, n in c.most_common())


def overview(run: RunData, smooth: float) -> list[tuple[str, str]]:
    """(field, value) rows of the summary table."""
    rows = [
        ("run", run.name),
        ("task", run.task),
        ("folder", str(run.run_dir)),
        ("status", status_of(run)),
        ("steps done / total", steps_text(run)),
    ]
    if "optim/skipped_steps" in run.series:  # the kept pass's, then those a rollback undid
        kept_skips, all_skips = run.spent("optim/skipped")
        gone = all_skips - kept_skips
        said = f" (and {gone:g} on steps a rollback or resume replaced)" if gone else ""
        rows.append(("skipped updates", fmt(run.last("optim/skipped_steps")) + said))
    if "throughput/step_s" in run.series:  # the kept trajectory's, and all the run spent
        kept, spent = (
            f"{s / 3600:.2f} h" if s >= 3600 else f"{s / 60:.1f} min"
            for s in run.spent("throughput/step_s")
        )
        all_of = f"{kept} on the kept steps; {spent} in all (with {len(run.replaced)} replaced)"
        rows.append(("time in steps", all_of if run.replaced else kept))
    notes = []
    if run.replaced:
        notes.append(
            f"{len(run.replaced)} step record(s) of an earlier pass replaced by a resume or rollback"
        )
    if run.bad_lines:
        notes.append(
            f"{run.bad_lines} unreadable metrics line(s) skipped (a line cut short by a crash, "
            "or the partial last line of a run being written)"
        )
    if run.impossible_mfu:
        notes.append(
            f"{run.impossible_mfu} step(s) logged an MFU above 100 % (the peak was measured too "
            "low): not drawn"
        )
    if run.bad_alarm_lines:
        notes.append(f"{run.bad_alarm_lines} unreadable alarms line(s) skipped")
    if notes:
        rows.append(("records", "; ".join(notes)))
    rows.append(("alarms", alarm_counts(run)))
    rows += [("warning", str(said)) for said in run.final.get("warnings") or []]  # vtok's
    rows += [("warning", said) for said in run.unreadable]
    rows.append(("loss visible", visible_text(run.visible())))
    smoothing = f"EMA factor {smooth:g} (debiased; raw values drawn faint)" if smooth else "none"
    rows.append(("smoothing", smoothing))
    return rows


def modality_rows(run: RunData, smooth: float) -> list[list[str]]:
    rows = []
    for m in run.modalities():
        s = run.series.get(f"loss/{m}")
        last, smoothed = fmt(run.last(f"loss/{m}")), "-"
        if s is not None and smooth > 0 and np.isfinite(s.values).any():
            smoothed = fmt(float(ema(s.values, smooth, s.steps)[-1]))  # over the finite steps
        if s is not None and (i := s.last_index()) < len(s.values) - 1:  # it ends non-finite
            bad, at = fmt(float(s.values[-1])), f"at step {s.steps[i]}"
            since = f"since step {s.steps[i + 1]}"
            last = f"{bad} ({since}; {fmt(float(s.values[i]))} {at})"
            smoothed += f" ({at}; {bad} {since})" if smoothed != "-" else ""
        kept, spent = (human(x) for x in run.spent(f"tokens/{m}"))  # and of the replaced steps
        tokens = f"{kept} kept; {spent} in all" if run.replaced else kept
        rows.append(
            [
                m,
                last,
                smoothed,
                fmt(run.last(f"unigram/{m}")),
                fmt(run.last(f"loss_norm/{m}")),
                fmt(run.last(f"val/loss/{m}")),
                fmt(run.final.get(f"val/loss/{m}")),
                fmt(run.final.get(f"val/unigram/{m}", run.last(f"val/unigram/{m}"))),
                fmt(run.final.get(f"val/margin/{m}", run.last(f"val/margin/{m}"))),
                fmt(run.final.get(f"val/ppl/{m}", run.last(f"val/ppl/{m}"))),
                tokens if f"tokens/{m}" in run.series else "-",
            ]
        )
    return rows


def eval_rows(run: RunData) -> list[list[str]]:
    """Every evaluation figure: its last value during training (and at which step), and final.json's."""
    final = [key for key, value in run.final.items() if type(value) in (int, float)]  # no bool
    keys = {key for key in run.series if key.startswith(("val/", "eval/"))}.union(final)
    rows = []
    for key in sorted(keys):
        series = run.series.get(key)
        at = f"{fmt(run.last(key))} (step {series.steps[series.last_index()]})" if series else "-"
        rows.append([key, at, fmt(run.final.get(key))])
    return rows


def visible_text(v: Visible | None) -> str:
    """The loss rule's verdict (tools/report/lead.py), for the summary."""
    if v is None:
        return "never (no loss EMA 15 % above its running minimum, nothing non-finite)"
    if v.series == "non-finite":
        return f"step {v.step}: a non-finite loss"
    return (
        f"step {v.step}: {v.series} loss EMA {v.level:.3f}, {v.level / v.minimum - 1:+.0%} over "
        f"its running minimum {v.minimum:.3f} (rule: 15 %)"
    )


def lead_text(step: int | None, visible: Visible | None) -> str:
    lead = lead_time(step, visible) if step is not None else None
    if lead is None:
        return "-"
    return f"{lead:+d} (before the loss)" if lead > 0 else f"{lead:+d} (after the loss)"


def alarm_rows(run: RunData) -> list[list[str]]:
    """One row per alarm; the last column is its lead over the loss rule (steps; + = earlier)."""
    rows = []
    visible = run.visible()
    for i, a in enumerate(run.alarms, 1):
        vals = a.get("values")
        vals = (
            ", ".join(f"{k}={fmt(v)}" for k, v in vals.items())
            if isinstance(vals, dict)
            else fmt(vals)
        )
        step = alarm_step(a)
        rows.append(
            [
                f"A{i}",
                fmt(step) if step is not None else "?",
                str(a.get("signal", "?")),
                str(a.get("modality") or "-"),
                str(a.get("action", "?")),
                vals,
                " ".join(
                    x
                    for x in (
                        str(a.get("message", "")),
                        f"[rule: {a['threshold']}]" if a.get("threshold") else "",
                        f"Likely cause: {a['cause']}." if a.get("cause") else "",
                        f"What to do: {a['advice']}." if a.get("advice") else "",
                    )
                    if x
                ),
                lead_text(step, visible),
            ]
        )
    return rows


# The final.json figures report.png's header lists.
HEADER_FINAL = (
    "val/loss",
    "val/unigram",
    "eval/psnr",
    "eval/ssim",
    "eval/baseline",
    "eval/palette",
    "eval/code_fraction",
)
MAX_ALARMS_IN_PNG = 12


def header_lines(run: RunData, smooth: float) -> list[tuple[str, float, str]]:
    """report.png's header: ``(text, font size, style)`` lines."""
    lines = [
        (f"earlyfuse report: {run.name}  (task {run.task})", 15.0, "bold"),
        (f"step {steps_text(run)}  |  {status_of(run)}  |  {alarm_counts(run)}", 10.5, "normal"),
    ]
    mono: list[tuple[str, float]] = []  # in the monospace font
    mods = modality_rows(run, smooth)
    if mods:
        which = f"EMA {smooth:g}" if smooth > 0 else "raw"
        losses = [
            f"{row[0]} {row[2] if smooth > 0 else row[1]}"
            + (f" (u {row[3]})" if row[3] != "-" else "")
            for row in mods
        ]
        mono.append((f"last train loss ({which}): " + "  ".join(losses), 10))
    final = [f"{k} {fmt(v)}" for k, v in sorted(run.final.items()) if k.startswith(HEADER_FINAL)]
    if final:
        mono.append(("final: " + "  ".join(final), 10))
    mono += [(f"warning: {said}", 10) for said in run.final.get("warnings") or []]
    mono += [(f"warning: {said}", 10) for said in run.unreadable]
    heldout = (run.heldout_eval.get("heldout") or {}).get("total") or {}
    if heldout:
        figures = [f"{m} {fmt(f['ce'], 3)}/{fmt(f.get('unigram'), 3)}" for m, f in heldout.items()]
        step = run.heldout_eval.get("step")  # of the release it evaluated: the run may have gone on
        late = "" if step == run.last_step else f"; the run is at step {run.last_step}"
        said = f"held-out (earlyfuse-eval of step {step}{late}), CE vs unigram: "
        mono.append((said + "  ".join(figures), 10))
    if run.alarms:
        mono.append((f"loss visible: {visible_text(run.visible())}", 10))
    for row, alarm in zip(alarm_rows(run)[:MAX_ALARMS_IN_PNG], run.alarms):
        mod = f" [{row[3]}]" if row[3] != "-" else ""
        said = f"{row[0]}  step {row[1]}  {row[2]}{mod} -> {row[4]} (lead {row[7]}): "
        # about two lines of the strip, cut between words and marked (the page has it whole)
        message = textwrap.shorten(str(alarm.get("message", "")), 160, placeholder=" [...]")
        mono.append((said + message, 9))
    if len(run.alarms) > MAX_ALARMS_IN_PNG:
        more = len(run.alarms) - MAX_ALARMS_IN_PNG
        mono.append((f"... and {more} more alarms (see report.html)", 9))
    return lines + [(text, size, "mono") for text, size in mono]


# --- HTML --------------------------------------------------------------------------------------------
CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:24px auto;max-width:1600px;
     color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0;border:1px solid #eee;padding:4px} figcaption{font-size:12px;color:#555;max-width:760px}
img.panel{width:760px;max-width:100%} .muted{color:#777} .tag{padding:1px 6px;border-radius:3px;color:#fff}
"""


PAGE = string.Template(
    "<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>earlyfuse report: $name</title>"
    "<style>$css</style></head><body><h1>earlyfuse report: $name</h1><p class=muted>task $task "
    "&middot; step $steps &middot; $alarms &middot; written $when UTC by earlyfuse-report</p>"
    "$sections</body></html>\n"
)


def _table(
    header: list[str],
    rows: list[list[str]],
    num_cols: Set[int] = frozenset(),
    raw_cols: Set[int] = frozenset(),
) -> str:
    """Cells are escaped except in ``raw_cols``; ``num_cols`` are right-aligned."""

    def cell(i, v):
        body = v if i in raw_cols else html.escape(v)
        return f"<td class=num>{body}</td>" if i in num_cols else f"<td>{body}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(i, v) for i, v in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(png: bytes, alt: str, cls: str = "panel") -> str:
    return f'<img class={cls} alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def html_page(
    run: RunData,
    smooth: float,
    panels: list[tuple[str, str, str, bytes]],
    reconstructions: bytes | None,
) -> str:
    """``panels``: (anchor, title, caption, png) in order. A section without content is left out."""
    esc = html.escape
    mods = modality_rows(run, smooth)
    modality_header = [
        "modality",
        "last train loss",
        f"train loss EMA {smooth:g}",
        "train unigram baseline (last)",
        "last CE / ln V",
        "last val loss",
        "final val loss",
        "val unigram baseline",
        "margin (baseline - loss)",
        "val ppl (final, else last)",
        "label tokens seen (kept steps; in all, with replaced ones)",
    ]
    evaluation = eval_rows(run)
    alarms = alarm_rows(run)
    for row in alarms:
        color = ACTION_COLOR.get(row[4], "#555")
        row[4] = f'<span class=tag style="background:{color}">{esc(row[4])}</span>'
    figures = "".join(
        f"<figure id={esc(anchor)}>{_img(png, title)}"
        + (f"<figcaption>{esc(caption)}</figcaption>" if caption else "")
        + "</figure>"
        for anchor, title, caption, png in panels
    )
    sections = {
        "Summary": _table(["field", "value"], [list(row) for row in overview(run, smooth)]),
        "Per modality": mods and _table(modality_header, mods, num_cols=set(range(1, 11))),
        "Evaluation": _table(
            ["figure", "last during training", "final (final.json)"], evaluation, num_cols={1, 2}
        )
        if evaluation
        else "<p class=muted>no evaluation logged yet</p>",
        "Held-out evaluation": run.heldout_eval
        and "<p class=muted>heldout_eval.json, written by earlyfuse-eval (docs/evaluation.md).</p>"
        f"<pre>{esc(format_eval(run.heldout_eval))}</pre>",
        "Alarms": _table(
            ["#", "step", "signal", "modality", "action", "values", "message", "lead (steps)"],
            alarms,
            num_cols={1},
            raw_cols={4},
        )
        if alarms
        else "<p>no alarms</p>",
        "Curves": "<p class=muted>Raw values faint, EMA solid; evaluation values as markers, "
        "final.json as stars; alarms as dashed vertical lines labelled A&lt;i&gt; (the rows "
        f"above; near ones share a label, A3-A5) with a diamond on the curve of their modality.</p><div class=grid>{figures}</div>"
        if panels
        else "<p class=muted>no steps logged yet</p>",
        "Reconstructions": reconstructions
        and "<p class=muted>vtok_reconstructions.png: held-out crops, original | reconstruction, "
        "one pair per row.</p>"
        + _img(reconstructions, "visual tokenizer reconstructions", "recon"),
        "final.json": run.final
        and "<pre>"
        + esc(json.dumps(run.final, indent=1, sort_keys=True, default=str, allow_nan=True))
        + "</pre>",
    }
    return PAGE.substitute(
        css=CSS,
        name=esc(run.name),
        task=esc(run.task),
        steps=esc(steps_text(run)),
        alarms=esc(alarm_counts(run)),
        when=f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M}",
        sections="".join(f"<h2>{title}</h2>{body}" for title, body in sections.items() if body),
    )
