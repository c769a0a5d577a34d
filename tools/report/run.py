"""Read a run folder as ``earlyfuse-train`` writes it, while it is being written or after
(docs/report.md, "What it reads"). A resumed or rolled-back run appends to ``metrics.jsonl``: a
step that goes back starts the pass the run goes on with, which replaces all earlier records from
that step on; the records up to the first step that goes back are kept apart (``first_pass``: the
loss rule of tools/report/lead.py reads them first), and so are those replaced (``replaced``: their
time and tokens were spent all the same). A line that does not parse is skipped and counted: the
last line of a running run may be half-written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from data.vocab import MODALITY_NAMES
from tools.evaluate import EVAL_FILE
from tools.report.lead import Visible, first_pass, loss_visible
from train import names as run_files
from train.names import (
    ALARMS_FILE,
    CONFIG_FILE,
    FINAL_FILE,
    HALTED_FILE,
    LOSS,
    METRICS_FILE,
    MIX,
    VAL,
    VTOK,
)


class NoMetrics(FileNotFoundError):
    """RUN_DIR has no metrics.jsonl."""


@dataclass
class Series:
    steps: np.ndarray  # int64, increasing
    values: np.ndarray  # float64, may hold NaN / inf
    key: str = ""  # the metric's name

    def last_index(self) -> int:
        """Of the last finite value, else of the last value."""
        ok = np.flatnonzero(np.isfinite(self.values))
        return int(ok[-1]) if ok.size else len(self.values) - 1


@dataclass
class RunData:
    run_dir: Path
    name: str
    task: str
    total_steps: int | None
    records: dict[int, dict]  # step -> its record in the run's latest pass
    series: dict[str, Series]
    final: dict = field(default_factory=dict)  # final.json, when written at the last step logged
    heldout_eval: dict = field(default_factory=dict)  # heldout_eval.json (earlyfuse-eval --out)
    alarms: list[dict] = field(default_factory=list)
    halted: dict = field(default_factory=dict)  # halted.json: a monitor stopped the run
    # (the step a pass went on from, its data.sources weights normalised), in step order
    target_mixes: list[tuple[int, dict[str, float]]] = field(default_factory=lambda: [(0, {})])
    config_read: bool = True  # config.yaml was there and read: train.steps is known
    first_pass: list[dict] = field(default_factory=list)  # records until a step first goes back
    replaced: list[dict] = field(default_factory=list)  # by a later record of the same step
    # steps whose logged MFU exceeded 100 % (a mis-measured peak): not drawn
    impossible_mfu: int = 0
    bad_lines: int = 0  # metrics lines that did not parse
    bad_alarm_lines: int = 0
    # final.json, heldout_eval.json or halted.json there but not read, each with why
    unreadable: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted(self.records)

    @property
    def last_step(self) -> int:
        return max(self.records) if self.records else 0

    @property
    def finished(self) -> bool:
        return bool(self.final)

    def visible(self) -> Visible | None:
        """The loss rule on the first pass (where its alarms saw the trouble), else on the pass
        the run went on with (a failure may show only after a rollback or resume)."""
        mixes = self.target_mixes
        restarts = [s for (s, mix), (_, was) in zip(mixes[1:], mixes) if was and mix != was]
        return loss_visible(self.first_pass, restarts) or loss_visible(
            [self.records[s] for s in self.steps], restarts
        )

    def spent(self, key: str) -> tuple[float, float]:
        """The sum of ``key`` over the kept steps, and over those and the replaced ones."""
        kept = float(np.nansum(s.values)) if (s := self.series.get(key)) else 0.0
        gone = [_number(r.get(key)) or 0.0 for r in self.replaced]
        return kept, kept + float(np.nansum(gone))

    def has(self, key: str) -> bool:
        s = self.series.get(key)
        return s is not None and bool(np.isfinite(s.values).any())

    def keys(self, prefix: str) -> list[str]:
        """Suffixes of the keys ``prefix<suffix>`` that hold at least one finite value (or, for
        ``loss/``, any value at all: a modality whose loss is all NaN is still present)."""
        found = [
            k[len(prefix) :]
            for k in self.series
            if k.startswith(prefix) and "/" not in k[len(prefix) :]
        ]
        return [k for k in found if prefix == LOSS or self.has(prefix + k)]

    def modalities(self) -> list[str]:
        """Modalities that have a train or validation loss anywhere (final.json included), in
        the trainer's order, then any other by name."""
        val_loss = VAL + LOSS  # val/loss/<modality>
        names = set(self.keys(LOSS)) | set(self.keys(val_loss))
        names |= {k[len(val_loss) :] for k in self.final if k.startswith(val_loss)}
        return [m for m in MODALITY_NAMES if m in names] + sorted(names - set(MODALITY_NAMES))

    def sources(self) -> list[str]:
        """Data sources of the delivered mix, in the latest config's order, then others by name."""
        found = set(self.keys(MIX))
        return [s for s in self.target_mix if s in found] + sorted(found - set(self.target_mix))

    @property
    def target_mix(self) -> dict[str, float]:  # the latest pass's
        return self.target_mixes[-1][1]

    def last(self, key: str) -> float | None:
        """The last finite value of a series, else its last value; None when it was never logged."""
        s = self.series.get(key)
        return None if s is None else float(s.values[s.last_index()])


def read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Objects of a JSONL file, and how many lines were skipped (unparsable or not an object)."""
    out, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None  # a bool is an int


# Utilisations: a value above 1 (100 %) cannot be true (the peak was measured too low, e.g. on a
# busy machine); the report never draws or prints one, it counts them instead.
UTILISATION_KEYS = ("throughput/mfu",)


def build_series(records: dict[int, dict]) -> dict[str, Series]:
    cols: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(records):
        for k, v in records[step].items():
            x = _number(v)
            if k == "step" or x is None:
                continue
            if k in UTILISATION_KEYS and x > 1.0:
                x = math.nan
            s, vals = cols.setdefault(k, ([], []))
            s.append(step)
            vals.append(x)
    return {
        k: Series(np.asarray(s, dtype=np.int64), np.asarray(v, dtype=np.float64), k)
        for k, (s, v) in cols.items()
    }


def _read_dict(path: Path, parse, unreadable: list[str] | None = None) -> dict:
    """The object of a file, or {} when it is missing, unreadable or not an object: a file we
    cannot read costs only what the report shows of it. With ``unreadable``, a file that is
    there but cannot be read is named in it, with why: the report says what it left out."""
    try:
        value = parse(path.read_text())
    except FileNotFoundError:
        return {}
    except Exception as e:
        if unreadable is not None:
            empty = path.is_file() and path.stat().st_size == 0
            why = "0 bytes: cut short by a full disk?" if empty else str(e).splitlines()[0][:200]
            if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark and not empty:
                why = f"not valid YAML at line {e.problem_mark.line + 1}: {e.problem}"
            unreadable.append(f"{path.name} is unreadable and left out ({why})")
        return {}
    if not isinstance(value, dict):
        if unreadable is not None:
            kind = "a JSON object" if path.suffix == ".json" else "a YAML mapping"
            unreadable.append(f"{path.name} is unreadable and left out (not {kind})")
        return {}
    return value


def _target_mix(cfg: dict) -> dict[str, float]:
    try:
        srcs = [
            (str(s["name"]), float(s.get("weight", 1.0)))
            for s in (cfg.get("data") or {}).get("sources") or []
        ]
    except (TypeError, KeyError, ValueError, AttributeError):
        return {}
    total = sum(w for _, w in srcs)
    return {n: w / total for n, w in srcs} if total > 0 else {}


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise NoMetrics(f"{run_dir} {'is not a folder' if run_dir.exists() else 'does not exist'}")
    if not path.is_file():
        started = (run_dir / CONFIG_FILE).is_file()  # a run writes metrics.jsonl at its first step
        why = "no step logged yet" if started else "is it a run folder written by earlyfuse-train?"
        raise NoMetrics(f"no metrics.jsonl in {run_dir} ({why})")
    lines, bad = read_jsonl(path)
    raw = [rec for rec in lines if alarm_step(rec) is not None]
    bad += len(lines) - len(raw)
    records: dict[int, dict] = {}
    for rec in raw:  # a step that goes back drops the earlier pass from there on (keys ascend)
        if records and rec["step"] <= next(reversed(records)):
            records = {step: kept for step, kept in records.items() if step < rec["step"]}
        records[rec["step"]] = rec
    unreadable: list[str] = []
    cfg = _read_dict(run_dir / CONFIG_FILE, yaml.safe_load, unreadable)  # the resolved config
    train_cfg = cfg.get("train")
    total = train_cfg.get("steps") if isinstance(train_cfg, dict) else None
    final = _read_dict(run_dir / FINAL_FILE, json.loads, unreadable)
    last = next(reversed(records), 0)
    halted = _read_dict(run_dir / HALTED_FILE, json.loads, unreadable)
    # The run's end files are written after its last metrics record: a later step there means
    # metrics.jsonl lost its end (cut, copied while written, restored from an older copy)
    ends = [((final.get("run") or {}).get("steps"), FINAL_FILE), (halted.get("step"), HALTED_FILE)]
    if later := [
        f"{name} step {step}" for step, name in ends if isinstance(step, int) and step > last
    ]:
        unreadable.append(
            f"{METRICS_FILE} ends at step {last}, but {' and '.join(later)}: it looks cut short; "
            "the report shows the steps it holds"
        )
    if (final.get("run") or {}).get("steps", last) != last:  # resumed since it was written
        final = {}
    alarms, bad_alarms = read_jsonl(f) if (f := run_dir / ALARMS_FILE).is_file() else ([], 0)
    # Each pass's config (the trainer keeps one a pass); a run written before has the latest's
    mixes = [
        (s, _target_mix(_read_dict(f, yaml.safe_load))) for s, f in run_files.pass_configs(run_dir)
    ]
    if mixes and mixes[0][0] > 0:  # no target is known before the first kept: the run began before
        mixes.insert(0, (0, {}))
    return RunData(
        run_dir=run_dir,
        name=str(cfg.get("name") or run_dir.resolve().name),
        task=str(
            cfg.get("task")
            or ("vtok" if any(VTOK in k for r in records.values() for k in r) else "?")
        ),
        total_steps=total if isinstance(total, int) and total > 0 else None,  # -1: until data ends
        records=records,
        series=build_series(records),
        final=final,
        heldout_eval=_read_dict(run_dir / EVAL_FILE, json.loads, unreadable),
        alarms=alarms,
        halted=halted,
        target_mixes=mixes or [(0, _target_mix(cfg))],
        config_read=bool(cfg),
        first_pass=first_pass(raw),
        replaced=[r for r in raw if r is not records.get(r["step"])],
        impossible_mfu=sum(
            (_number(r.get("throughput/mfu")) or 0.0) > 1.0 for r in records.values()
        ),
        bad_lines=bad,
        bad_alarm_lines=bad_alarms,
        unreadable=unreadable,
    )


def alarm_step(record: dict) -> int | None:
    """The integer ``step`` of an alarm or a metrics record, else None."""
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def fmt(v, digits: int = 4) -> str:
    """A number for a table: 4 significant digits, NaN/inf spelt out, '-' for missing."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v:.{digits}g}"
    return str(v)
