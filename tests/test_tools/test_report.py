"""earlyfuse-report on a synthetic LM run shaped like the real thing (a resume that relogs a step
range, a half-written last line, validation records, a NaN step, skipped steps, alarms) and on a
real visual-tokenizer run made by earlyfuse-train."""

from __future__ import annotations

import html
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from trainrun import run_checkout, train

from tools.report import DEFAULT_SMOOTH, main, write_report
from tools.report.page import header_lines
from tools.report.panels import panels_for
from tools.report.run import load_run

MODS = ("text", "code", "image", "video", "structure")
SOURCES = {"code": 0.3, "text": 0.3, "scenes": 0.2, "clips": 0.2}
ALARMS = [
    {
        "step": 120,
        "signal": "loss_spike",
        "modality": None,
        "values": {"score": 9.1, "loss": 7.9},
        "action": "skip",
        "message": "loss 7.9 > mean + 6 sigma",
    },
    {
        "step": 130,
        "signal": "nonfinite",
        "modality": None,
        "values": {"loss": float("nan")},
        "action": "skip",
        "message": "NaN loss: update dropped",
    },
    {
        "step": 175,
        "signal": "modality_stagnation",
        "modality": "image",
        "values": {"ratio": 1.04},
        "action": "warn",
        "message": "image loss rising while others improve",
    },
    {
        "step": 205,
        "signal": "chance_level",
        "modality": "video",
        "values": {"ce_norm": 0.97},
        "action": "rollback",
        "message": "video back near chance: roll back to step 150 and skip the window",
    },
]


def record(step: int, rng: np.random.Generator, bogus: bool = False) -> dict:
    """One optimizer step as the LM task logs it (modalities absent from some steps)."""
    r: dict = {"step": step}
    present = [
        m for m in MODS if not (m == "video" and step % 3) and not (m == "code" and step % 2)
    ]
    floors = {"text": 2.6, "code": 1.9, "image": 4.8, "video": 5.1, "structure": 0.4}
    total_tok, ce_sum = 0, 0.0
    for m in MODS:
        n = int(rng.integers(400, 900)) if m in present else 0
        r[f"tokens/{m}"] = n
        if not n:
            continue
        ce = floors[m] + 3.5 * math.exp(-step / 40) + rng.normal(0, 0.05)
        if m == "image" and step > 150:
            ce += (step - 150) * 0.01  # the image modality drifting back up
        r[f"loss/{m}"] = ce
        r[f"loss_norm/{m}"] = ce / math.log(4096 if m in ("text", "code") else 1000)
        r[f"monitor/logz/{m}"] = 2.0 + 0.002 * step + rng.normal(0, 0.02)
        r[f"monitor/hidden_norm/{m}"] = 30 + 0.05 * step
        r[f"monitor/logit_gap/{m}"] = 0.5 - 0.001 * step
        total_tok, ce_sum = total_tok + n, ce_sum + ce * n
    r["train/loss"] = 99.0 if bogus else ce_sum / total_tok
    grad = 1.5 * math.exp(-step / 80) + 0.3 + abs(rng.normal(0, 0.05))
    if step == 120:
        r["train/loss"], grad = 7.9, 60.0
    if step == 130:
        r["train/loss"], grad = float("nan"), float("nan")
    shares = rng.dirichlet([w * 200 for w in SOURCES.values()])
    r.update({f"mix/{s}": float(x) for s, x in zip(SOURCES, shares)})
    r.update(
        {
            "optim/grad_norm": grad,
            "optim/lr": 3e-3 * min(1, step / 20) * (0.5 + 0.5 * math.cos(math.pi * step / 300)),
            "optim/skipped": float(step in (120, 130)),
            "optim/skipped_steps": (step >= 120) + (step >= 130),
            "throughput/units_per_s": 6000 + rng.normal(0, 200),
            "throughput/step_s": 0.5,
            "throughput/data_wait": 0.01,
            "throughput/mfu": 0.31 + rng.normal(0, 0.01),
            "throughput/eta_s": 50.0,
        }
    )
    if step % 50 == 0:
        for m in MODS:
            v = floors[m] + 3.6 * math.exp(-step / 40) + 0.05
            r[f"val/loss/{m}"], r[f"val/ppl/{m}"] = v, math.exp(v)
        r["val/loss"] = 3.0
    return r


def synthetic_run(root: Path) -> Path:
    """Steps 1..200 logged, a resume from the step-150 checkpoint relogs 151..200 (the first
    pass's train/loss there is a bogus 99), then 201..240 and a half-written line."""
    run = root / "synth"
    run.mkdir()
    srcs = "".join(f"  - {{name: {s}, shards: [x/{s}], weight: {w}}}\n" for s, w in SOURCES.items())
    (run / "config.yaml").write_text(
        f"task: lm\nname: synth_lm\ntrain:\n  steps: 300\ndata:\n  sources:\n{srcs}"
    )
    rng = np.random.default_rng(0)
    lines = [record(s, rng, bogus=s > 150) for s in range(1, 201)]
    lines += [record(s, rng) for s in range(151, 241)]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    partial = json.dumps(record(241, rng))[:57]
    (run / "metrics.jsonl").write_text(text + partial)
    (run / "alarms.jsonl").write_text("".join(json.dumps(a) + "\n" for a in ALARMS) + '{"step": 2')
    return run


def assert_self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert (
        "<link" not in page
        and "<script" not in page
        and not re.search(r"""(src|href)=["']?(https?:|//)""", page)
    )
    assert "url(" not in page and "@import" not in page
    for src in re.findall(r"""src=["']?([^"' >]+)""", page):
        assert src.startswith("data:image/png;base64,"), src[:60]


def test_synthetic_lm_run(tmp_path, capsys):
    run = synthetic_run(tmp_path)
    data = load_run(run)
    assert data.last_step == 240 and len(data.records) == 240
    assert len(data.replaced) == 50 and data.bad_lines == 1 and data.bad_alarm_lines == 1
    assert all(data.records[s]["train/loss"] < 20 for s in range(151, 201))  # the resumed pass won
    assert data.modalities() == list(MODS) and data.sources() == list(SOURCES)

    assert main([str(run), "--smooth", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "synth_lm (lm): step 240 / 300 (80%)" in out and "4 alarm(s)" in out
    png, page = run / "report" / "report.png", (run / "report" / "report.html").read_text()
    # The summary page: the header over the four main panels, two rows; every panel after it.
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 1400 and 2 * 300 < im.size[1] < 2 * 350 + 500
    with Image.open(run / "report" / "report_panels.png") as im:
        assert im.format == "PNG" and im.size[0] >= 1400 and im.size[1] > 6 * 300
    assert_self_contained(page)
    for m in MODS:
        assert f"<td>{m}</td>" in page
    for i, a in enumerate(ALARMS, 1):
        row = re.search(rf"<td>A{i}</td><td class=num>{a['step']}</td><td>{a['signal']}</td>", page)
        assert row, f"alarm A{i} missing from the table"
        assert html.escape(a["message"]) in page
    for anchor in (
        "loss",
        "val",
        "loss_norm",
        "mix",
        "tokens",
        "grad",
        "lr",
        "throughput",
        "util",
        "monitor_logz",
        "monitor_hidden_norm",
        "monitor_logit_gap",
    ):
        assert f"<figure id={anchor}>" in page
    assert "240 / 300 (80%)" in page and "50 step record(s) of an earlier pass replaced" in page
    assert "EMA factor 0.8" in page and "running or stopped" in page


def test_report_of_a_real_vtok_run(tiny_raw, tmp_path):
    run = tmp_path / "vtok"
    train(
        [
            "experiment=vtok_debug",
            f"vtok_data.raw=[{tiny_raw}]",
            f"run_dir={run}",
            "train.steps=4",
            "vtok_data.heldout_crops=16",
        ]
    )
    out = tmp_path / "elsewhere"
    rep = write_report(run, out=out)
    assert rep.png == out / "report.png" and rep.png.is_file() and not (run / "report").exists()
    assert {"loss", "grad", "lr", "psnr", "ssim", "codes"} <= set(rep.panels)
    # the visual tokenizer's loss is its reconstruction loss, not a cross-entropy
    loss = next(panel for panel in panels_for(rep.run) if panel.key == "loss")
    assert loss.ylabel == "reconstruction loss (L1/L2)"
    page = rep.html.read_text()
    assert_self_contained(page)
    assert (
        "<td>image</td>" in page
        and "no alarms" in page
        and "finished" in page
        and "4 / 4 (100%)" in page
    )
    assert "eval/psnr" in page and "eval/baseline_psnr" in page and "Reconstructions" in page
    assert (
        page.count("data:image/png;base64,") == len(rep.panels) + 1
    )  # the panels and the reconstructions
    # The run's warnings (tiny images skipped, PSNR below the equal-bits baselines after 4 steps)
    # are in the summary table and report.png's header, not only in final.json's dump.
    warnings = json.loads((run / "final.json").read_text())["warnings"]
    header = [text for text, _, _ in header_lines(rep.run, DEFAULT_SMOOTH)]
    assert any("baseline" in said for said in warnings)
    for said in warnings:
        assert f"<td>warning</td><td>{html.escape(said)}</td>" in page
        assert f"warning: {said}" in header


def test_missing_run_folder_fails_clearly(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    script = (
        Path(sys.executable).parent / "earlyfuse-report"
    )  # the console script, as a user runs it
    p = subprocess.run([str(script), str(tmp_path / "empty")], capture_output=True, text=True)
    assert p.returncode == 2 and str(tmp_path / "empty") in p.stderr and not p.stdout
    # a run that has started (its config.yaml written) but logged no step yet says so
    (tmp_path / "empty" / "config.yaml").write_text("task: lm\nname: starting\n")
    p = subprocess.run([str(script), str(tmp_path / "empty")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr == (
        f"earlyfuse-report: no metrics.jsonl in {tmp_path / 'empty'} (no step logged yet)\n"
    )
    # an --out that cannot be a folder: one line naming it, not mkdir's traceback
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 3.0}))
    (tmp_path / "a_file").write_text("")
    argv = [str(script), str(tmp_path / "empty"), "--out", str(tmp_path / "a_file" / "report")]
    p = subprocess.run(argv, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr == (
        f"earlyfuse-report: {tmp_path / 'a_file' / 'report'}: Not a directory\n"
    )
    h = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert (
        h.returncode == 0
        and "--smooth" in h.stdout
        and "--out" in h.stdout
        and "alarms" in h.stdout
    )


def test_a_run_that_has_just_started(tmp_path):
    run = tmp_path / "young"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "train/lo')  # the first line, half-written
    rep = write_report(run)
    assert rep.panels == [] and rep.png.is_file()
    page = rep.html.read_text()
    assert "no steps logged yet" in page and "no alarms" in page


def test_the_header_wraps_inside_the_page_and_the_summary_leads_with_the_main_panels():
    from tools.report import summary_of
    from tools.report.panels import render_header, wrap_lines

    long = ("val/loss/image 2.4137  " * 30).strip()
    lines = [("earlyfuse report: a run with a long name " * 3, 15, "bold"), (long, 10, "mono")]
    wrapped = wrap_lines(lines, 1520)
    assert len(wrapped) > 4 and all(text.strip() for text, _, _ in wrapped)
    assert " ".join(text.strip() for text, _, _ in wrapped[-4:]).count("val/loss/image") > 5
    with Image.open(io.BytesIO(render_header(lines, 1520))) as im:
        pixels = np.asarray(im.convert("L"))
    assert pixels.shape[1] == 1520 and pixels[:, -8:].min() > 240, "text runs off the right edge"
    assert pixels[:, :200].min() < 100  # the text is there

    drawn = [(key, "", "", b"") for key in ("loss", "grad", "lr", "mix", "val", "throughput")]
    assert [entry[0] for entry in summary_of(drawn)] == ["loss", "val", "mix", "grad"]


def test_the_loss_by_position_and_the_needle_tables_are_drawn(tmp_path, capsys):
    """An evaluation with --long-context in the run folder: a position panel (CE per bucket,
    per modality) and the needle tables on the page and the console."""
    run = tmp_path / "lc"  # a short run: one panel besides the one under test
    run.mkdir()
    (run / "config.yaml").write_text("task: lm\nname: lc\ntrain:\n  steps: 3\n")
    lines = [{"step": step, "train/loss": 4.0 - step} for step in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    def cells(values):
        return {"buckets": [{"ce": v, "tokens": 10, "ce_first": values[0]} for v in values]}

    score = {"digit": 0.25, "whole": 0.0, "prompts": 4, "digits": 20}
    ev = {
        "release": "r",
        "step": 240,
        "position_loss": {
            "seq_len": 256,
            "buckets": [[0, 64], [64, 128], [128, 256]],
            "stretches": [9, 6, 3],
            "modalities": {"text": cells([3.0, 2.5, 2.2]), "video": cells([5.0, 4.0, None])},
        },
        "passkey": {
            "lengths": [256],
            "depths": [0.0, 1.0],
            "trials": 4,
            "digits": 5,
            "cells": {"256": {"0": score, "1": score}},
            "control": {"256": score},
        },
    }
    (run / "heldout_eval.json").write_text(json.dumps(ev))
    assert main([str(run)]) == 0
    page = (run / "report" / "report.html").read_text()
    assert "<figure id=position>" in page and "loss by position" in page
    assert "passkey" in page and "control" in page
    printed = capsys.readouterr().out
    assert "0-64" in printed and "128-256" in printed and "passkey" in printed


def test_a_probe_every_100_steps_is_drawn_at_its_measured_values(tmp_path):
    """The EMA factor is per step: a probe logged every 100 steps is not averaged with the probe
    100 steps before (at 0.9 per point its last marker read half-way between two probes)."""
    from matplotlib.figure import Figure

    from tools.report.panels import Ctx, panels_for, x_limits

    run = tmp_path / "probes"
    run.mkdir()
    gaps = {100: 0.3, 200: 0.9, 300: 0.1}
    lines = [
        {"step": s, "train/loss": 3.0, "monitor/dependence_gap": gaps.get(s)} for s in range(1, 301)
    ]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in lines)
    )
    data = load_run(run)
    panel = next(p for p in panels_for(data) if p.key == "monitor_dependence_gap")
    steps, drawn = panel.draw(Figure().add_subplot(), Ctx(data, 0.9, x_limits(data)))[
        "monitor/dependence_gap"
    ]
    assert list(steps) == [100, 200, 300]
    assert np.allclose(drawn, [0.3, 0.9, 0.1], atol=1e-3), drawn


def test_the_mix_of_a_one_step_run_is_drawn(tmp_path):
    """A stack over one step has no width: the one step's mix is drawn one step wide."""
    from matplotlib.figure import Figure

    from tools.report.panels import Ctx, panels_for, x_limits

    run = tmp_path / "one"
    run.mkdir()
    record = {"step": 1, "train/loss": 7.8, "mix/code": 0.25, "mix/text": 0.75}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    data = load_run(run)
    ax = Figure().add_subplot()
    next(p for p in panels_for(data) if p.key == "mix").draw(ax, Ctx(data, 0.9, x_limits(data)))
    bands = [c.get_paths()[0].get_extents() for c in ax.collections]
    assert len(bands) == 2 and all(b.width >= 1 for b in bands)
    assert [round(b.height, 2) for b in bands] == [0.25, 0.75]


def test_a_rolled_back_stretch_stays_drawn_dotted(tmp_path):
    """A rollback logs steps again and the pass it goes on with wins; the blow-up its alarms saw
    (the first pass) is drawn dotted, or the alarms would point at a curve that never rose."""
    from matplotlib.figure import Figure

    from tools.report.panels import Ctx, panels_for, x_limits

    run = tmp_path / "rolled"
    run.mkdir()
    first = [{"step": s, "train/loss": 9.0 if s > 15 else 3.0} for s in range(1, 21)]
    again = [{"step": s, "train/loss": 3.0} for s in range(11, 31)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + again))
    data = load_run(run)
    assert len(data.replaced) == 10 and data.records[18]["train/loss"] == 3.0
    ax = Figure().add_subplot()
    next(p for p in panels_for(data) if p.key == "loss").draw(ax, Ctx(data, 0.9, x_limits(data)))
    dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 1
    assert list(dotted[0].get_xdata()) == list(range(11, 21))
    assert list(dotted[0].get_ydata()) == [3.0] * 5 + [9.0] * 5


def test_a_rolled_back_lr_and_its_skipped_steps_stay_drawn(tmp_path):
    """The lr x100 that caused a rollback, and the steps it skipped, were drawn nowhere: the lr
    panel showed the kept pass alone, and the skip marks only the kept pass's skipped steps."""
    first = [
        {"step": s, "optim/lr": 0.1 if s > 15 else 1e-3, "optim/grad_norm": 1.0 + s}
        | ({"optim/skipped": 1} if s > 16 else {})
        for s in range(1, 21)
    ]
    again = [{"step": s, "optim/lr": 1e-3, "optim/grad_norm": 1.0} for s in range(11, 31)]
    data = load_run(write_records(tmp_path / "r", first + again))
    lr = draw_panel(data, "lr")
    (dotted,) = [line for line in lr.get_lines() if line.get_linestyle() == ":"]
    assert list(dotted.get_xdata()) == list(range(11, 21)) and max(dotted.get_ydata()) == 0.1
    assert lr.get_yscale() == "log"  # the kept schedule, 100x below, not flattened on zero
    grad = draw_panel(data, "grad")
    (marks,) = [c for c in grad.collections if "replaced pass" in str(c.get_label())]
    assert [tuple(xy) for xy in marks.get_offsets()] == [(s, 1.0 + s) for s in range(17, 21)]


def test_a_resumed_pass_drops_the_steps_it_has_not_reached_yet(tmp_path, capsys):
    """Killed at step 65 with its last checkpoint at 60, resumed and reported at step 62: the
    run is at 62, and steps 63-65 of the killed pass are no longer its trajectory (the resumed
    pass will train them again on other weights)."""
    run = tmp_path / "resumed"
    run.mkdir()
    (run / "config.yaml").write_text("task: lm\nname: resumed\ntrain:\n  steps: 80\n")
    killed = [{"step": s, "train/loss": 5.0 - s / 100} for s in range(1, 66)]
    resumed = [{"step": s, "train/loss": 1.0} for s in (61, 62)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in killed + resumed))
    data = load_run(run)
    assert data.last_step == 62 and max(data.records) == 62
    assert data.records[62]["train/loss"] == 1.0 and len(data.replaced) == 5
    assert main([str(run)]) == 0
    assert "resumed (lm): step 62 / 80 (78%)" in capsys.readouterr().out


def test_a_run_the_data_ended_early_and_a_run_extended_after_finishing(tmp_path, capsys):
    """data.mode=epoch ended at step 66 of train.steps 1000 (final.json's run.steps 66): finished
    where the data ended, the step axis ends there (it ran to 1000, the curves squeezed into its
    first 7 %) and the final evaluation is drawn at 66. A run finished at 30, resumed with
    train.steps=60 and stopped at 49 keeps the final.json of step 30: it is not finished, and
    that evaluation is not the run's."""
    from tools.report.panels import x_limits

    def run_dir(name: str, steps: int, logged: int, final_at: int) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(f"task: lm\nname: {name}\ntrain:\n  steps: {steps}\n")
        records = [
            {"step": s, "train/loss": 5.0, "val/loss/text": 4.0} for s in range(1, logged + 1)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        final = {"run": {"steps": final_at, "task": "lm"}, "val/loss/text": 3.5}
        (run / "final.json").write_text(json.dumps(final))
        return run

    epoch = load_run(run_dir("epoch", 1000, 66, 66))
    assert epoch.finished and x_limits(epoch)[1] < 70
    assert header_lines(epoch, DEFAULT_SMOOTH)[1][0].startswith("step 66 (the data ended")
    assert main([str(epoch.run_dir)]) == 0
    assert "epoch (lm): step 66 (the data ended" in capsys.readouterr().out
    extended = load_run(run_dir("extended", 60, 49, 30))
    assert not extended.finished and extended.final == {}
    assert header_lines(extended, DEFAULT_SMOOTH)[1][0].startswith("step 49 / 60 (82%)  |  running")


def test_skipped_updates_count_those_a_rollback_undid(tmp_path):
    """Steps 61-64 skipped as spikes, then a rollback to the step-50 checkpoint: the kept pass's
    counter (optim/skipped_steps) is back at 0, while the alarms list four skips; the summary
    said "0" alone."""
    from tools.report.page import overview

    run = tmp_path / "rolled"
    run.mkdir()

    def rec(step: int, skipped: int, total: int) -> dict:
        return {
            "step": step,
            "train/loss": 3.0,
            "optim/skipped": skipped,
            "optim/skipped_steps": total,
        }

    first = [rec(s, int(61 <= s <= 64), max(0, min(s, 64) - 60)) for s in range(1, 65)]
    again = [rec(s, 0, 0) for s in range(51, 81)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first + again))
    rows = dict(overview(load_run(run), DEFAULT_SMOOTH))
    assert rows["skipped updates"] == "0 (and 4 on steps a rollback or resume replaced)"


def test_an_alarm_is_marked_on_a_curve_only_where_the_curve_is(tmp_path):
    """A probe logged at steps 100 and 120 and an alarm at step 64: the probe's panel has the
    alarm's dashed line but no diamond (it was put at the probe's step-100 value, a point the
    curve never had); the loss panel, logged every step, has its diamond."""
    from matplotlib.figure import Figure

    from tools.report.panels import Ctx, draw_alarms, panels_for, x_limits

    run = tmp_path / "probe"
    run.mkdir()
    recs = [{"step": s, "train/loss": 3.0} for s in range(1, 121)]
    for r in recs[99::20]:
        r["monitor/gen_code_distinct"] = 120.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    alarm = {"step": 64, "signal": "loss_spike", "modality": None, "action": "skip"}
    (run / "alarms.jsonl").write_text(json.dumps(alarm) + "\n")
    data = load_run(run)
    ctx = Ctx(data, 0.9, x_limits(data))
    for key, diamonds in (("loss", 1), ("monitor_gen_code_distinct", 0)):
        ax = Figure().add_subplot()
        panel = next(p for p in panels_for(data) if p.key == key)
        draw_alarms(ax, ctx, panel.draw(ax, ctx) or {})
        assert len([ln for ln in ax.get_lines() if ln.get_marker() == "D"]) == diamonds, key


def test_the_header_says_which_step_the_heldout_evaluation_is_of(tmp_path):
    """heldout_eval.json of the step-20 release, the run gone on to step 60: the header said
    "held-out (earlyfuse-eval)" alone, read as the run's present figures."""
    run = tmp_path / "later"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 3.0}) + "\n" for s in range(1, 61))
    )
    ev = {"step": 20, "heldout": {"total": {"text": {"ce": 5.5, "unigram": 4.9, "tokens": 9}}}}
    (run / "heldout_eval.json").write_text(json.dumps(ev))
    header = [text for text, _, _ in header_lines(load_run(run), DEFAULT_SMOOTH)]
    said = (
        "held-out (earlyfuse-eval of step 20; the run is at step 60), CE vs unigram: text 5.5/4.9"
    )
    assert said in header
    ev["step"] = 60
    (run / "heldout_eval.json").write_text(json.dumps(ev))
    header = [text for text, _, _ in header_lines(load_run(run), DEFAULT_SMOOTH)]
    assert "held-out (earlyfuse-eval of step 60), CE vs unigram: text 5.5/4.9" in header


def test_a_report_read_by_head_ends_quietly(tmp_path):
    """`earlyfuse-report RUN | head -1`: the reader leaving is no error (it was a BrokenPipeError
    traceback, exit 1), as for `earlyfuse-prep stats DIR | head`."""
    import signal

    run = synthetic_run(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    script = Path(sys.executable).parent / "earlyfuse-report"
    proc = subprocess.run(
        [str(script), str(run)], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300
    )
    os.close(write_end)
    assert proc.returncode == 128 + signal.SIGPIPE and proc.stderr == "", proc.stderr


def test_skipped_updates_count_those_of_every_replaced_pass(tmp_path):
    """Two rollbacks: steps 61-64 skipped, back to step 50; steps 71-72 skipped in the second
    pass, back to step 70: all six replaced skips are counted, not only the first pass's four."""
    from tools.report.page import overview

    run = tmp_path / "rolled_twice"
    run.mkdir()

    def rec(step: int, skipped: int) -> dict:
        return {"step": step, "train/loss": 3.0, "optim/skipped": skipped, "optim/skipped_steps": 0}

    first = [rec(s, int(61 <= s <= 64)) for s in range(1, 65)]
    second = [rec(s, int(s in (71, 72))) for s in range(51, 73)]
    third = [rec(s, 0) for s in range(71, 91)]
    lines = "".join(json.dumps(r) + "\n" for r in first + second + third)
    (run / "metrics.jsonl").write_text(lines)
    rows = dict(overview(load_run(run), DEFAULT_SMOOTH))
    assert rows["skipped updates"] == "0 (and 6 on steps a rollback or resume replaced)"


def draw_panel(data, key: str):
    """The axes of one panel of ``data`` as drawn, with the alarms, on report.png's canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from tools.report.panels import AXES, DPI, PANEL_SIZE, Ctx, draw_alarms, panels_for, x_limits

    fig, ctx = Figure(figsize=PANEL_SIZE, dpi=DPI), Ctx(data, 0.9, x_limits(data))
    FigureCanvasAgg(fig)
    ax = fig.add_axes(AXES)
    draw_alarms(ax, ctx, next(p for p in panels_for(data) if p.key == key).draw(ax, ctx) or {})
    ax.set_xlim(*ctx.xlim)
    return ax


def test_each_pass_draws_its_own_target_mix(tmp_path):
    """Resumed from step 50 with other data.sources weights: the target lines were config.yaml's,
    the latest pass's, over steps 1-50 too. The trainer keeps each pass's config (a pass resumed
    from step 80 and replaced by a later one from 50 is dropped), the report draws each over its
    steps."""
    from types import SimpleNamespace

    from train.callbacks.run_info import RunInfo

    run = tmp_path / "remixed"

    def start_pass(step: int, code: float) -> None:
        srcs = f"[{{name: code, weight: {code}}}, {{name: text, weight: {1 - code}}}]"
        cfg = f"task: lm\nname: remixed\ntrain:\n  steps: 100\ndata:\n  sources: {srcs}\n"
        info = RunInfo(run_dir=run, resolved_yaml=cfg, describe="remixed", is_main=True)
        info.pre_train(SimpleNamespace(total_steps=100), step)

    for step, code in ((0, 0.5), (80, 0.9), (50, 0.2)):
        start_pass(step, code)
    recs = [{"step": s, "train/loss": 3.0, "mix/code": 0.3, "mix/text": 0.7} for s in range(1, 101)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = load_run(run)
    assert [(s, round(m["code"], 2)) for s, m in data.target_mixes] == [(0, 0.5), (50, 0.2)]
    (target,) = [ln for ln in draw_panel(data, "mix").get_lines() if ln.get_label().startswith("t")]
    levels = dict(zip(target.get_xdata(), target.get_ydata()))
    assert levels[1] == levels[50] == 0.5 and levels[51] == levels[100] == 0.2


def test_a_source_has_one_colour_in_every_panel(tmp_path):
    """Sources named code and text, and a third: the mix panel coloured them C0, C1, C2 by
    position while the loss panels drew code green and text blue."""
    from matplotlib.colors import to_hex

    run = tmp_path / "colours"
    run.mkdir()
    srcs = "[{name: code}, {name: text}, {name: scenes}]"
    (run / "config.yaml").write_text(f"task: lm\ntrain:\n  steps: 20\ndata:\n  sources: {srcs}\n")
    mix = {"mix/code": 0.3, "mix/text": 0.5, "mix/scenes": 0.2}
    recs = [{"step": s, "loss/code": 2.0, "loss/text": 3.0, **mix} for s in range(1, 21)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = load_run(run)
    lines = {ln.get_label(): to_hex(ln.get_color()) for ln in draw_panel(data, "loss").get_lines()}
    stack = draw_panel(data, "mix").collections[:3]  # the bands, in the config's order
    bands = {c.get_label(): to_hex(c.get_facecolor()[0], keep_alpha=False) for c in stack}
    assert bands["code"] == lines["code"] and bands["text"] == lines["text"]
    assert list(bands) == ["code", "text", "scenes"] and len(set(bands.values())) == 3


def test_alarms_close_in_steps_share_one_label(tmp_path):
    """Alarms at steps 100, 101 and 103 of a 300-step run: their A1, A2, A3 were drawn on top of
    one another. Now they read A1-A3 once, beside A4 (step 200)."""
    run = tmp_path / "close"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 3.0}) + "\n" for s in range(1, 301))
    )
    alarms = [{"step": s, "signal": "loss_spike", "action": "skip"} for s in (100, 101, 103, 200)]
    alarms[1]["action"] = "warn"
    (run / "alarms.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alarms))
    texts = draw_panel(load_run(run), "loss").texts
    assert sorted(t.get_text() for t in texts) == ["A1-A3", "A4"]
    renderer = texts[0].get_figure().canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in texts), key=lambda box: box.x0)
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))


def test_a_finished_run_without_its_config_claims_no_reason_for_its_end(tmp_path, capsys):
    """final.json at step 40, config.yaml unreadable: the header said "the data ended,
    data.mode=epoch", a reason the report cannot know without train.steps."""
    run = tmp_path / "noconfig"
    run.mkdir()
    (run / "config.yaml").write_text("task: [lm\n")
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 3.0}) + "\n" for s in range(1, 41))
    )
    (run / "final.json").write_text(json.dumps({"run": {"steps": 40}}))
    header = header_lines(load_run(run), DEFAULT_SMOOTH)[1][0]
    assert header.startswith(
        "step 40 / ? (config.yaml missing or unreadable: the target is unknown)  |  finished"
    )
    assert "data ended" not in header


def test_the_evaluation_table_names_the_step_of_the_value_it_shows(tmp_path):
    """val/loss/text 4.2 at step 50 and NaN at step 100: the table showed 4.2 "(step 100)", a
    value that step never had."""
    from tools.report.page import eval_rows

    run = tmp_path / "nan_eval"
    run.mkdir()
    recs = [{"step": s, "train/loss": 3.0} for s in range(1, 101)]
    recs[49]["val/loss/text"], recs[99]["val/loss/text"] = 4.2, float("nan")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert eval_rows(load_run(run)) == [["val/loss/text", "4.2 (step 50)", "-"]]


def test_steps_before_the_first_kept_config_have_no_target(tmp_path):
    """A run started before the trainer kept each pass's config, resumed since from step 50 with
    new weights: only that pass's config is kept, and steps 1-50 were drawn with its targets."""
    run = tmp_path / "straddles"
    (run / "pass_configs").mkdir(parents=True)
    srcs = "[{name: code, weight: 0.2}, {name: text, weight: 0.8}]"
    cfg = f"task: lm\ntrain:\n  steps: 100\ndata:\n  sources: {srcs}\n"
    (run / "config.yaml").write_text(cfg)
    (run / "pass_configs" / "from_step_00000050.yaml").write_text(cfg)
    recs = [{"step": s, "train/loss": 3.0, "mix/code": 0.3, "mix/text": 0.7} for s in range(1, 101)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (target,) = [
        ln for ln in draw_panel(load_run(run), "mix").get_lines() if ln.get_label()[0] == "t"
    ]
    levels = dict(zip(target.get_xdata(), target.get_ydata()))
    assert np.isnan(levels[1]) and np.isnan(levels[50]) and levels[51] == levels[100] == 0.2


def write_records(run: Path, records: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_a_nan_in_the_pass_the_run_went_on_with_is_visible(tmp_path):
    """Steps 1-20, then a pass from step 11 whose loss is NaN at step 35: the loss rule read the
    first pass alone and said "never (... nothing non-finite)"."""
    from tools.report.page import overview

    first = [{"step": s, "train/loss": 3.0} for s in range(1, 21)]
    again = [{"step": s, "train/loss": math.nan if s == 35 else 3.0} for s in range(11, 41)]
    rows = dict(overview(load_run(write_records(tmp_path / "r", first + again)), DEFAULT_SMOOTH))
    assert rows["loss visible"] == "step 35: a non-finite loss"


def test_the_last_train_loss_ema_is_the_curves_end_for_a_sparse_modality(tmp_path):
    """Video in one step of three: the table's EMA smoothed per logged value, the curve per step
    (5.52 against 4.18 on one page, for the same "EMA 0.9")."""
    from matplotlib.figure import Figure

    from tools.report.page import modality_rows
    from tools.report.panels import Ctx, x_limits

    recs = [{"step": s, "train/loss": 3.0} for s in range(1, 31)]
    for r in recs[::3]:
        r.update({"loss/video": 9.0 - r["step"] / 5, "tokens/video": 100})
    data = load_run(write_records(tmp_path / "r", recs))
    panel = next(p for p in panels_for(data) if p.key == "loss")
    _, drawn = panel.draw(Figure().add_subplot(), Ctx(data, 0.9, x_limits(data)))["video"]
    (row,) = modality_rows(data, 0.9)
    assert row[0] == "video" and row[2] == f"{drawn[-1]:.4g}", (row, drawn[-1])


def test_status_of_a_run_whose_end_files_cannot_be_read_is_unknown(tmp_path):
    from tools.report.page import status_of

    run = write_records(tmp_path / "r", [{"step": 1, "train/loss": 3.0}])
    (run / "final.json").write_text('{"run": {"st')
    assert status_of(load_run(run)) == (
        "unknown (final.json there but unreadable: see the warning)"
    )


def test_a_metrics_file_that_lost_its_end_is_said(tmp_path):
    """metrics.jsonl cut at step 60 of a run that finished at 125: the report read it as a run
    running or stopped at step 60, without a word."""
    run = write_records(tmp_path / "r", [{"step": s, "train/loss": 3.0} for s in range(1, 61)])
    (run / "final.json").write_text(json.dumps({"run": {"steps": 125}}))
    assert load_run(run).unreadable == [
        "metrics.jsonl ends at step 60, but final.json step 125: it looks cut short; the report "
        "shows the steps it holds"
    ]


def test_a_config_yaml_that_is_no_yaml_is_named_with_its_line(tmp_path):
    run = write_records(tmp_path / "r", [{"step": 1, "train/loss": 3.0}])
    (run / "config.yaml").write_text("name: r\ntrain:\n  bad: [unclosed\n")
    (said,) = load_run(run).unreadable
    assert said.startswith("config.yaml is unreadable and left out (not valid YAML at line 4"), said


def test_a_resume_onto_a_harder_mix_is_no_visible_failure(tmp_path):
    """Resumed at step 80 with more weight on a harder source: the total loss rises 16 % over
    its running minimum, and the loss rule called it the failure every alarm lagged."""
    from tools.report.page import overview

    recs = [{"step": s, "train/loss": 2.7 if s <= 80 else 3.2} for s in range(1, 121)]
    run = write_records(tmp_path / "r", recs)
    (run / "pass_configs").mkdir()
    for step, code in ((0, 0.1), (80, 0.5)):
        sources = f"[{{name: text, weight: {1 - code}}}, {{name: code, weight: {code}}}]"
        (run / "pass_configs" / f"from_step_{step:08d}.yaml").write_text(
            f"data:\n  sources: {sources}\n"
        )
    rows = dict(overview(load_run(run), DEFAULT_SMOOTH))
    assert rows["loss visible"].startswith("never"), rows["loss visible"]
    (run / "pass_configs" / "from_step_00000080.yaml").unlink()  # the same mix: a failure
    assert dict(overview(load_run(run), DEFAULT_SMOOTH))["loss visible"].startswith("step 113")


def test_the_last_train_loss_says_it_is_nan(tmp_path):
    """loss/text NaN from step 30 on: the row showed the step-29 value as the last train loss."""
    from tools.report.page import modality_rows

    recs = [
        {"step": s, "loss/text": math.nan if s >= 30 else 3.0, "tokens/text": 100}
        for s in range(1, 31)
    ]
    (row,) = modality_rows(load_run(write_records(tmp_path / "r", recs)), DEFAULT_SMOOTH)
    assert row[1] == "NaN (since step 30; 3 at step 29)"
    assert row[2] == "3 (at step 29; NaN since step 30)"


def test_a_skipped_step_without_a_finite_grad_norm_is_marked_at_the_top(tmp_path):
    """Step 10 skipped with a NaN grad norm: its triangle was drawn at a value interpolated
    between steps 9 and 11, a point the curve never had. It is at the top, under the NaN ✕."""
    recs = [{"step": s, "optim/grad_norm": 1.0, "optim/skipped": 0} for s in range(1, 21)]
    recs[9].update({"optim/grad_norm": math.nan, "optim/skipped": 1})
    recs[4]["optim/skipped"] = 1  # a finite grad norm: marked at it
    ax = draw_panel(load_run(write_records(tmp_path / "r", recs)), "grad")
    marks = {c.get_label(): c for c in ax.collections if c.get_label().startswith("skipped")}
    on_curve, top = marks["skipped step (1)"], marks["skipped, grad NaN/inf (1)"]
    assert on_curve.get_offsets().tolist() == [[5, 1.0]]
    assert top.get_offsets().tolist() == [[10, 0.9]]  # in axes units: under the top edge's ✕


def test_an_alarm_without_a_modality_is_marked_on_the_loss_alone(tmp_path):
    """A loss_spike alarm got a diamond on the throughput, MFU and grad norm curves too (their
    first curve was returned as "total"); monitor/alarms was labelled "total"."""
    recs = [
        {
            "step": s,
            "train/loss": 3.0,
            "throughput/units_per_s": 500.0,
            "throughput/mfu": 0.4,
            "optim/grad_norm": 1.0,
            "monitor/alarms": float(s >= 10),
        }
        for s in range(1, 21)
    ]
    run = write_records(tmp_path / "r", recs)
    (run / "alarms.jsonl").write_text(json.dumps({"step": 10, "signal": "loss_spike"}) + "\n")
    data = load_run(run)
    for key, diamonds in (("loss", 1), ("throughput", 0), ("util", 0), ("grad", 0)):
        lines = draw_panel(data, key).get_lines()
        assert len([ln for ln in lines if ln.get_marker() == "D"]) == diamonds, key
    labels = [ln.get_label() for ln in draw_panel(data, "monitor_alarms").get_lines()]
    assert "monitor/alarms" in labels and "total" not in labels


def test_time_and_tokens_count_the_replaced_steps_too(tmp_path):
    """Steps 1-20, then 11-30, each 1 s and 100 text tokens: the summary said 0.5 min, the
    kept trajectory's alone, while 40 steps were trained."""
    from tools.report.page import modality_rows, overview

    recs = [
        {"step": s, "loss/text": 3.0, "tokens/text": 100, "throughput/step_s": 1.0}
        for s in [*range(1, 21), *range(11, 31)]
    ]
    data = load_run(write_records(tmp_path / "r", recs))
    said = "0.5 min on the kept steps; 0.7 min in all (with 10 replaced)"
    assert dict(overview(data, DEFAULT_SMOOTH))["time in steps"] == said
    assert modality_rows(data, DEFAULT_SMOOTH)[0][-1] == "3k kept; 4k in all"
    assert [ln.get_label() for ln in draw_panel(data, "tokens").get_lines()][
        1
    ] == "text\n(3k kept, 4k in all)"


def test_every_legend_fits_its_panel(tmp_path):
    """The legends stand right of the axes: the longest labels (a resumed run's token counts,
    "structure (19.8k kept, 26.1k in all)") ran past the figure's edge and were cut."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from tools.report.panels import Ctx, panel_figure, panels_for, x_limits

    recs = [
        {"step": s, "loss/structure": 3.0, "tokens/structure": 1_234_567, "throughput/step_s": 1.0}
        for s in [*range(1, 21), *range(11, 31)]
    ]
    data = load_run(write_records(tmp_path / "r", recs))
    ctx = Ctx(data, 0.9, x_limits(data))
    for panel in panels_for(data):
        fig = panel_figure(panel, ctx)
        renderer = FigureCanvasAgg(fig).get_renderer()
        for ax in fig.axes:
            if legend := ax.get_legend():
                assert legend.get_window_extent(renderer).x1 <= fig.bbox.x1, panel.key


def test_a_long_alarm_message_is_cut_between_words_in_the_header(tmp_path):
    """report.png's header cut a message at 100 characters, mid-word ("risen: te"): it is cut
    between words now, and marked; the page keeps it whole."""
    message = (
        "the loss stayed +156% over its minimum for 5 steps; " + "x" * 120 + "; risen: text +109%"
    )
    alarm = {"step": 10, "signal": "divergence", "action": "rollback", "message": message}
    run = write_records(tmp_path / "r", [{"step": s, "train/loss": 3.0} for s in range(1, 21)])
    (run / "alarms.jsonl").write_text(json.dumps(alarm) + "\n")
    [line] = [t for t, _, _ in header_lines(load_run(run), DEFAULT_SMOOTH) if "divergence" in t]
    assert line.endswith("for 5 steps; [...]"), line


def test_a_report_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path):
    """A full disk (here a file-size limit, which fails a write the same way): report.png was
    written in place, left truncated over the good one beside the old run's page, and the
    command ended in a traceback."""
    out = tmp_path / "out"
    assert main([str(synthetic_run(tmp_path)), "--out", str(out)]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    other = write_records(tmp_path / "other", [{"step": s, "train/loss": 3.0} for s in (1, 2)])
    script = Path(sys.executable).parent / "earlyfuse-report"
    p = run_checkout([str(script), str(other), "--out", str(out)], file_size_limit=20_000)
    assert p.returncode == 1 and p.stderr == (
        f"earlyfuse-report: {out / 'report.png'}: File too large; no file of the report there "
        "was replaced\n"
    )
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no .tmp left either


def test_an_unreadable_heldout_evaluation_is_named_not_dropped(tmp_path, capsys):
    """A heldout_eval.json that a full disk left empty: the report said nothing and had no
    held-out section, as if the run had never been evaluated."""
    run = write_records(tmp_path / "run", [{"step": s, "train/loss": 3.0} for s in (1, 2)])
    (run / "heldout_eval.json").write_text("")
    said = "heldout_eval.json is unreadable and left out (0 bytes: cut short by a full disk?)"
    data = load_run(run)
    assert data.unreadable == [said]
    assert f"warning: {said}" in [text for text, _, _ in header_lines(data, DEFAULT_SMOOTH)]
    assert main([str(run)]) == 0
    assert capsys.readouterr().err == f"earlyfuse-report: warning: {run}: {said}\n"
    assert f"<td>{said}</td>" in (run / "report" / "report.html").read_text()
    (run / "heldout_eval.json").write_text("[1, 2]")
    assert load_run(run).unreadable == [
        "heldout_eval.json is unreadable and left out (not a JSON object)"
    ]


def test_a_run_folder_the_report_cannot_write_into_suggests_out(tmp_path, small_tmpfs, capsys):
    """Said "robase/report: Permission denied" alone; a read-only mount ended in a traceback."""
    run = write_records(small_tmpfs / "run", [{"step": s, "train/loss": 3.0} for s in (1, 2)])
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    assert main([str(run)]) == 2
    assert capsys.readouterr().err == (
        f"earlyfuse-report: {run / 'report'}: Read-only file system (give --out DIR to write the "
        "report elsewhere)\n"
    )
    assert main([str(run), "--out", str(tmp_path / "rep")]) == 0
