"""``earlyfuse-report RUN_DIR``: every curve of a run, with the monitors' alarms marked, as PNGs
and one self-contained HTML page (docs/report.md). The folder is read by ``run.py``, the figures
are ``panels.py``'s, the words and the page ``page.py``'s; report.png (the header over the main
panels) and report_panels.png (every panel) are composed here with Pillow.
"""

from __future__ import annotations

import argparse
import errno
import io
import sys
from dataclasses import dataclass
from pathlib import Path

from data.shards.storage import write_all_atomic
from tools.evaluate.table import format_eval
from tools.report.run import NoMetrics, RunData, load_run

DEFAULT_SMOOTH = 0.9
# report.png is the page read at a glance: the header and these panels (those the run has, in
# this order, up to SUMMARY_COUNT); report_panels.png has every panel.
SUMMARY_PANELS = ("loss", "val", "psnr", "loss_norm", "codes", "mix")
SUMMARY_COUNT = 4


@dataclass
class Report:
    png: Path  # the summary page: header and the main panels
    panels_png: Path  # every panel
    html: Path
    panels: list[str]  # the panel ids drawn
    run: RunData


def compose(header: bytes, panels: list[bytes], columns: int = 2) -> bytes:
    """The header strip above the panels in a grid, as one PNG."""
    from PIL import Image

    head = Image.open(io.BytesIO(header)).convert("RGB")
    imgs = [Image.open(io.BytesIO(p)).convert("RGB") for p in panels]
    columns = max(1, min(columns, len(imgs)))
    w, h = imgs[0].size if imgs else (head.size[0] // columns, 0)
    rows = -(-len(imgs) // columns)
    canvas = Image.new("RGB", (max(w * columns, head.size[0]), head.size[1] + rows * h), "white")
    canvas.paste(head, (0, 0))
    for i, im in enumerate(imgs):
        canvas.paste(im, ((i % columns) * w, head.size[1] + (i // columns) * h))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def summary_of(drawn: list[tuple]) -> list[tuple]:
    """The panels of the summary page: the main ones this run has, else the first ones."""
    by_key = {entry[0]: entry for entry in drawn}
    chosen = [by_key[key] for key in SUMMARY_PANELS if key in by_key][:SUMMARY_COUNT]
    rest = [entry for entry in drawn if entry not in chosen]
    return chosen + rest[: SUMMARY_COUNT - len(chosen)]


def write_report(
    run_dir: str | Path, out: str | Path | None = None, smooth: float = DEFAULT_SMOOTH
) -> Report:
    """Read RUN_DIR and write ``report.png`` and ``report.html`` into ``out`` (default
    RUN_DIR/report). Raises ``NoMetrics`` when RUN_DIR has no metrics.jsonl."""
    from tools.report import panels as figures
    from tools.report.page import header_lines, html_page

    if not 0 <= smooth < 1:
        raise ValueError(f"--smooth must be in [0, 1), got {smooth}")
    run = load_run(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    ctx = figures.Ctx(run=run, smooth=smooth, xlim=figures.x_limits(run))
    panels = figures.panels_for(run) if run.records or run.final else []
    drawn = [(p.key, p.title, p.note, figures.render(p, ctx)) for p in panels]
    width = int(figures.PANEL_SIZE[0] * figures.DPI) * (2 if len(drawn) > 1 else 1)
    header = figures.render_header(header_lines(run, smooth), width)
    title = [(f"earlyfuse report: {run.name}: every panel ({len(drawn)})", 13.0, "bold")]
    recon = run.run_dir / "vtok_reconstructions.png"
    page = html_page(run, smooth, drawn, recon.read_bytes() if recon.is_file() else None)
    png, panels_png, html = out / "report.png", out / "report_panels.png", out / "report.html"
    # The three replace the previous report together or not at all (a full disk): never a
    # truncated image over a good one, nor a page of one run beside the images of another.
    write_all_atomic(
        {
            png: compose(header, [d[3] for d in summary_of(drawn)]),
            panels_png: compose(figures.render_header(title, width), [d[3] for d in drawn]),
            html: page.encode("utf-8"),
        }
    )
    return Report(png=png, panels_png=panels_png, html=html, panels=[d[0] for d in drawn], run=run)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="earlyfuse-report",
        description="Draw every curve of an earlyfuse-train run with the monitors' alarms marked: "
        "train loss total and per modality (raw and EMA), validation loss per modality, "
        "normalised CE against chance, the delivered data mix, tokens per modality, grad norm "
        "with skipped steps, lr, throughput/MFU/data wait, the monitor signals, and for a "
        "visual-tokenizer run PSNR/SSIM/code use. Writes OUT/report.png (the summary: a header "
        "and the main panels), OUT/report_panels.png (every panel) and OUT/report.html (one self-contained page: images inlined, summary, "
        "evaluation and alarms tables). Safe to run on a run that is still training.",
        epilog="example: earlyfuse-report runs/demo/lm && open runs/demo/lm/report/report.html",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run folder (holds metrics.jsonl; config.yaml, "
        "final.json, alarms.jsonl and vtok_reconstructions.png are used when present)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="where to write report.png, report_panels.png and report.html (default: "
        "RUN_DIR/report)",
    )
    p.add_argument(
        "--smooth",
        type=float,
        default=DEFAULT_SMOOTH,
        metavar="F",
        help=f"EMA factor for train curves, in [0, 1): s = F*s + (1-F)*x, debiased; 0 = raw only "
        f"(default {DEFAULT_SMOOTH}; for runs of many thousands of steps, 0.99 or 0.995)",
    )
    args = p.parse_args(argv)
    if not 0 <= args.smooth < 1:
        p.error(f"--smooth must be in [0, 1), got {args.smooth}")
    return args


def failure_line(e: OSError, out_given: bool) -> str:
    """What stopped the report, in one line naming the file or folder."""
    from data.cli.common import USER_ERRORS

    if isinstance(e, NoMetrics):
        return str(e)
    said = f"{e.filename}: {e.strerror or e}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and not out_given:  # a run not ours
        return f"{said} (give --out DIR to write the report elsewhere)"
    if not isinstance(e, USER_ERRORS):  # a full disk, an I/O error: written all or none
        return f"{said}; no file of the report there was replaced"
    return said


def main(argv=None) -> int:
    from data.cli.common import USER_ERRORS

    args = parse_args(argv)
    try:
        rep = write_report(args.run_dir, args.out, args.smooth)
    except OSError as e:  # NoMetrics, an --out that cannot be made or written, a full disk
        print(f"earlyfuse-report: {failure_line(e, args.out is not None)}", file=sys.stderr)
        theirs = isinstance(e, USER_ERRORS) or e.errno == errno.EROFS  # --out fixes a read-only run
        return 2 if theirs else 1  # 1: the machine's (a full disk)
    run = rep.run
    from data.cli.common import reader_left
    from tools.report.page import alarm_counts, steps_text

    try:
        print(
            f"{run.name} ({run.task}): step {steps_text(run)}, {len(rep.panels)} panels, {alarm_counts(run)}"
        )
        print(f"wrote {rep.png} (summary) and {rep.panels_png.name} (every panel)")
        print(f"wrote {rep.html}")
        for said in run.unreadable:  # e.g. a heldout_eval.json that a full disk cut short
            print(f"earlyfuse-report: warning: {run.run_dir}: {said}", file=sys.stderr)
        if run.heldout_eval:  # earlyfuse-eval --out RUN_DIR/heldout_eval.json
            print(format_eval(run.heldout_eval))
    except BrokenPipeError:  # `earlyfuse-report RUN | head -1`
        return reader_left()
    return 0


if __name__ == "__main__":
    sys.exit(main())
