"""The loss rule and lead times (tools/report/lead.py) and how the report shows them: an alarm
that came before the loss showed the failure is marked with its lead."""

from __future__ import annotations

import json
import math

from tools.report import write_report
from tools.report.lead import first_pass, lead_time, loss_visible


def rec(step: int, text: float, image: float) -> dict:
    return {
        "step": step,
        "train/loss": (text + image) / 2,
        "loss/text": text,
        "tokens/text": 500,
        "loss/image": image,
        "tokens/image": 500,
    }


def falling(step: int) -> float:
    return 3.0 + 4.0 * math.exp(-step / 20)


def test_the_loss_rule_finds_a_modality_rise_and_ignores_the_early_fall():
    recs = [
        rec(s, falling(s), falling(s) + (0.0 if s <= 120 else 0.02 * (s - 120)))
        for s in range(1, 200)
    ]
    v = loss_visible(recs)
    # 15 % above the minimum, through a 20-step EMA: some 40 steps after the rise begins
    assert v is not None and v.series == "image" and 140 < v.step < 180, v
    assert loss_visible([rec(s, falling(s), falling(s)) for s in range(1, 200)]) is None
    nan = recs[:50] + [{**recs[50], "train/loss": float("nan")}]
    assert loss_visible(nan).series == "non-finite"
    image_nan = recs[:50] + [{**recs[50], "loss/image": float("inf")}]
    assert loss_visible(image_nan).step == recs[50]["step"]
    no_tokens = recs[:50] + [{**recs[50], "loss/image": float("nan"), "tokens/image": 0}]
    assert loss_visible(no_tokens) is None
    assert lead_time(100, v) == v.step - 100 and lead_time(100, None) is None


def test_first_pass_stops_where_a_rollback_relogs_steps():
    recs = [{"step": s} for s in (1, 2, 3, 4, 2, 3, 4, 5)]
    assert [r["step"] for r in first_pass(recs)] == [1, 2, 3, 4]


def test_report_marks_the_lead_of_an_alarm_before_the_loss_showed_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = [
        rec(s, falling(s), falling(s) + (0.0 if s <= 120 else 0.02 * (s - 120)))
        for s in range(1, 200)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    alarm = {
        "step": 110,
        "signal": "hidden_drift",
        "modality": "image",
        "action": "warn",
        "values": {"growth": 9.0},
        "message": "final hidden norm of image grew 9x",
        "threshold": "hidden norm > 8x its early value",
        "cause": "norm growth",
        "advice": "lower optim.lr",
    }
    (run / "alarms.jsonl").write_text(json.dumps(alarm) + "\n")
    page = write_report(run).html.read_text()
    visible = loss_visible(recs)
    assert f"step {visible.step}: image loss EMA" in page
    assert f"+{visible.step - 110} (before the loss)" in page
    assert "What to do: lower optim.lr." in page and "[rule: hidden norm &gt; 8x" in page
