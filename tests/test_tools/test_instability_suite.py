"""The instability suite's machinery (tools/monitor_eval/instability.py) on run folders shaped like the
trainer's: reading a run, the loss rule on its first pass, the summary and the table. The suite
itself (real runs, ~10 minutes) is a benchmark, not a test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import train.app as app
from tools.monitor_eval import instability
from tools.monitor_eval.cases import CASES, MIXES, load_cases, mix_override
from tools.monitor_eval.instability import read_run, summarize, table


def write_run(folder, *, blow_up_at=None, alarms=(), rollback_to=None, val=3.4):
    folder.mkdir(parents=True)
    recs = []
    for s in range(1, 201):
        loss = 3.0 + 4.0 * math.exp(-s / 20)
        if blow_up_at and s > blow_up_at:
            loss *= 2
        recs.append({"step": s, "train/loss": loss, "loss/text": loss, "tokens/text": 512})
    if rollback_to:  # the surviving trajectory relogs steps after the rollback
        recs += [{**r, "train/loss": 3.1} for r in recs[rollback_to:]]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "alarms.jsonl").write_text("".join(json.dumps(a) + "\n" for a in alarms))
    (folder / "final.json").write_text(json.dumps({"val/loss": val}))
    out = f"ROLLBACK at step {blow_up_at + 5}\n" if rollback_to else ""
    (folder / "stdout.log").write_text(out)


def test_read_summarize_and_tabulate(tmp_path):
    lr_jump = next(c for c in CASES if c.name == "lr-jump")
    healthy = next(c for c in CASES if c.name == "healthy-debug-0")
    alarms = [
        {"step": 102, "signal": "loss_spike", "action": "skip", "modality": None},
        {"step": 105, "signal": "divergence", "action": "rollback", "modality": None},
    ]
    write_run(tmp_path / "mon", blow_up_at=101, alarms=alarms, rollback_to=90, val=3.36)
    write_run(tmp_path / "twin", blow_up_at=101, val=5.6)
    write_run(tmp_path / "healthy", val=3.34)
    mon, twin, ok = (read_run(tmp_path / n) for n in ("mon", "twin", "healthy"))
    visible = mon["visible"]["step"]  # read on the first pass, before the relogged steps
    assert 102 <= visible <= 110 and mon["rollbacks"] == 1 and mon["val_loss"] == 3.36
    assert ok["visible"] is None
    s = summarize(lr_jump, mon, twin)
    assert s["detected"] and s["first"]["signal"] == "loss_spike" and s["lead"] == visible - 102
    results = [
        {"case": lr_jump.__dict__, "run": {"rc": 0}, "monitored": mon, "twin": twin, "summary": s},
        {
            "case": healthy.__dict__,
            "run": {"rc": 0},
            "monitored": ok,
            "summary": summarize(healthy, ok, None),
        },
    ]
    md = table(results)
    assert "| lr-jump |" in md and "loss_spike @102 (skip)" in md and "3.360 (1 rollback)" in md
    assert "5.600" in md and "| healthy-debug-0 |" in md and "none (goal)" in md


def test_mixes_name_every_healthy_source():
    sources, validation = mix_override("code-heavy", "/data")
    assert sources.startswith("data.sources=[") and sources.count("{name:") == 7
    assert "{name: code, shards: [/data/suite/code], weight: 0.45}" in sources
    assert validation == "data.validation=[{name: val, shards: [/data/suite/val], weight: 1.0}]"
    assert mix_override("code-only", "/data", validation=False)[1] == "data.validation=[]"
    assert "[/data/suite_tv/scenes]" in mix_override("code-text-scenes", "/data")[0]


def test_healthy_controls_reach_beyond_what_the_detectors_were_tuned_on():
    healthy = [case for case in CASES if case.kind == "healthy"]
    assert all(case.mix is None or case.mix in MIXES for case in CASES)
    assert {"debug", "demo"} <= {case.experiment for case in healthy}  # the presets as they are
    assert {"text-only", "code-only", "video-only", "images-small"} <= {
        case.mix for case in healthy
    }
    assert any(case.resume_at for case in healthy) and len({case.seed for case in healthy}) >= 12
    assert any("train.steps=100" in case.overrides for case in healthy)


SUITE_CONFIGS = sorted((Path(instability.CONFIGS) / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", SUITE_CONFIGS, ids=lambda path: path.stem)
def test_every_case_config_composes_through_the_suite_search_path(preset):
    """The cases' configs sit beside the suite, out of the user's presets; the search path the
    suite gives every run makes `experiment=instab_*` compose onto configs/ as it did there."""
    assert not (Path(app.CONFIG_DIR) / "experiment" / preset.name).exists()
    overrides = [instability.SEARCHPATH, f"experiment={preset.stem}"]
    with initialize_config_dir(config_dir=app.CONFIG_DIR, version_base="1.3"):
        cfg = app.to_run_config(compose("config", overrides=overrides))[0]
    assert cfg.name == preset.stem and cfg.task == "lm"
    assert cfg.data.sources and all("runs/instab/data/" in s.shards[0] for s in cfg.data.sources)
    # Every case runs one of these, or a user's preset as it is (the presets' healthy controls).
    assert {case.experiment for case in CASES} - {"debug", "demo"} == {
        path.stem for path in SUITE_CONFIGS
    }


def test_a_case_with_an_unknown_field_names_the_cases_file(tmp_path):
    cases = tmp_path / "cases.yaml"
    cases.write_text("- {name: x, experiment: debug, kind: healthy, what: y, sead: 3}\n")
    with pytest.raises(ValueError, match=rf"{cases}: .*'sead'"):
        load_cases(cases)


def test_the_suite_trains_its_visual_tokenizer_from_the_checkout():
    """Its ``earlyfuse-train`` subprocess starts where every case's run starts: the checkout."""
    from tools.monitor_eval import data

    assert data.REPO == instability.REPO and (data.REPO / "pyproject.toml").is_file()


def test_the_suite_writes_a_source_as_tokenize_does(tiny_tokens, tmp_path):
    """A token shard read back and written again by the suite's data builder: the shard and the
    manifest entry that tokenize wrote, so the loader reads the suite's folders as a user's."""
    from tools.monitor_eval import data

    base = json.loads((tiny_tokens / "manifest.json").read_text())
    first = next(entry for entry in base["shards"] if entry["source"] == "scenes")
    docs = data.read_source(tiny_tokens, "scenes")[: first["samples"]]
    data.write_folder(tmp_path, tiny_tokens, {"scenes": docs})
    assert json.loads((tmp_path / "manifest.json").read_text())["shards"] == [first]
