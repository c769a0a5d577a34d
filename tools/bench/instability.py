"""The monitors on real instabilities (issue 16): recall, lead time, false alarms and recovery.

Every case is a real run of ``earlyfuse-train experiment=instab_*`` (configs/experiment/), one
subprocess each, with the default monitors (configs/monitor/default.yaml); nothing is injected
into training: each failure comes from its config (no QK-norm or no z-loss under a rising lr, an
lr x100 stretch) or its data (token sources that turn bad part-way: tools/bench/instab/data.py).
For each case it reports which detector fired first and when, when the failure became visible
in the loss (tools/report/lead.py: the total or a modality's loss EMA 10 % above its running
minimum, or non-finite), the lead time, what the monitors did, and the final validation loss:
with the monitors' actions, with every action set to ``log`` (run only when an action changed
the run: otherwise the two runs are the same), and of the healthy control.

    .venv/bin/python tools/bench/instability.py                 # everything, ~10 min on 2 cores
    .venv/bin/python tools/bench/instability.py --cases lr-jump healthy-debug-0 --jobs 1
    .venv/bin/python tools/bench/instability.py --prepare-only   # only build the data

The data is built once into runs/instab/data (the instab_* configs read it there); the runs go
to ROOT/runs (ROOT: runs/instab). Writes ROOT/results.json and ROOT/table.md, prints the table,
and the CPU seconds (user + sys of every run and of this process) beside the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.bench.instab.cases import ACTING, CASES, LOG_ONLY, Case, mix_override  # noqa: E402
from tools.bench.instab.data import build  # noqa: E402
from tools.report.lead import first_pass, loss_above_control, loss_visible  # noqa: E402

SEVERE = ("warn", "skip", "rollback", "halt")
DATA = REPO / "runs" / "instab" / "data"  # where configs/experiment/instab_*.yaml read it


def train(case: Case, run_dir: Path, data: Path, extra: tuple[str, ...] = ()) -> dict:
    """One ``earlyfuse-train`` subprocess; returns its exit code and CPU/wall seconds."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "train.app",
        f"experiment={case.experiment}",
        f"run_dir={run_dir}",
        f"train.seed={case.seed}",
        f"data.seed={case.seed}",
        "train.progress=false",
        *([mix_override(case.mix, str(data))] if case.mix else []),
        *case.overrides,
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")
        ),
    }
    t0 = time.perf_counter()
    with open(run_dir / "stdout.log", "w") as out, open(run_dir / "stderr.log", "w") as err:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    return {
        "rc": p.returncode,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": time.perf_counter() - t0,
        "cmd": " ".join(cmd[2:]),
    }


def read_run(run_dir: Path) -> dict:
    """What one run did: its alarms, the loss rule on its first pass, its final losses."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if run_dir.exists() else []
    recs = [json.loads(x) for x in lines if x.strip()]
    first = first_pass(recs)
    alarms_path = run_dir / "alarms.jsonl"
    alarms = (
        [json.loads(x) for x in alarms_path.read_text().splitlines() if x.strip()]
        if alarms_path.is_file()
        else []
    )
    final_path = run_dir / "final.json"
    final = json.loads(final_path.read_text()) if final_path.is_file() else {}
    last = {r["step"]: r for r in recs}
    tail = [last[s]["train/loss"] for s in sorted(last)[-20:]]
    out = (run_dir / "stdout.log").read_text() if (run_dir / "stdout.log").is_file() else ""
    vis = loss_visible(first)
    return {
        "first_pass": first,
        "alarms": alarms,
        "visible": None if vis is None else {"step": vis.step, "series": vis.series},
        "val_loss": final.get("val/loss"),
        "train_loss_last20": sum(tail) / len(tail) if tail else None,
        "rollbacks": out.count("ROLLBACK at step"),
        "steps_done": max(last) if last else 0,
    }


def summarize(case: Case, mon: dict, twin: dict | None, control: dict | None = None) -> dict:
    severe = [a for a in mon["alarms"] if a["action"] in SEVERE]
    early = [a for a in severe if case.onset is not None and a["step"] < case.onset]
    after = [a for a in severe if case.onset is None or a["step"] >= case.onset]
    first = after[0] if after else None
    vis = mon["visible"] if case.kind == "failure" else None
    if case.kind == "failure" and twin is not None and twin["visible"] is not None:
        vis = twin["visible"]  # the failure as it unfolds without the monitors' actions
    if case.kind == "failure" and case.same_data and control is not None:
        traj = (twin or mon)["first_pass"]
        above = loss_above_control(traj, control["first_pass"])
        if above is not None and (vis is None or above.step < vis["step"]):
            vis = {"step": above.step, "series": f"{above.series} vs healthy"}
    lead = None if first is None or vis is None else vis["step"] - first["step"]
    return {
        "detected": first is not None,
        "first": None
        if first is None
        else {
            "signal": first["signal"],
            "modality": first.get("modality"),
            "step": first["step"],
            "action": first["action"],
        },
        "before_onset": [(a["step"], a["signal"], a.get("modality")) for a in early],
        "signals": sorted({(a["signal"], a.get("modality") or "") for a in severe}),
        "visible": vis,
        "lead": lead,
        "actions": sorted({a["action"] for a in severe}),
    }


def run_case(case: Case, root: Path, data: Path, controls: dict) -> dict:
    rec: dict = {"case": case.__dict__ | {"overrides": list(case.overrides)}}
    rec["run"] = train(case, root / "runs" / case.name, data)
    rec["monitored"] = read_run(root / "runs" / case.name)
    acted = any(a["action"] in ACTING for a in rec["monitored"]["alarms"]) or rec["run"]["rc"] == 3
    if case.kind == "failure" and acted:
        rec["twin_run"] = train(case, root / "runs" / f"{case.name}-log", data, LOG_ONLY)
        rec["twin"] = read_run(root / "runs" / f"{case.name}-log")
    rec["summary"] = summarize(case, rec["monitored"], rec.get("twin"), controls.get(case.control))
    if case.kind == "healthy":
        controls[case.name] = rec["monitored"]
    print(f"  done {case.name}: {short(rec)}", flush=True)
    return rec


def short(rec: dict) -> str:
    s = rec["summary"]
    first = s["first"]
    det = f"{first['signal']}@{first['step']}" if first else "none"
    return f"first alarm {det}, loss visible {s['visible']}, rc {rec['run']['rc']}"


def fmt_loss(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(results: list[dict]) -> str:
    by_name = {r["case"]["name"]: r for r in results}
    rows = [
        "| case | what | first warn+ alarm (step, action) | loss visible (rule) | lead | "
        "other signals | final val loss: monitors / log only / healthy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c, s, mon = r["case"], r["summary"], r["monitored"]
        first = s["first"]
        det = (
            f"{first['signal']}{'[' + first['modality'] + ']' if first['modality'] else ''} "
            f"@{first['step']} ({first['action']})"
            if first
            else "**none**"
        )
        vis = s["visible"]
        vis_s = f"{vis['step']} ({vis['series']})" if vis else "never"
        lead = "-" if s["lead"] is None else f"{s['lead']:+d}"
        others = ", ".join(f"{sig}{'[' + m + ']' if m else ''}" for sig, m in s["signals"])
        if s["before_onset"]:
            others += f"; **{len(s['before_onset'])} before onset**"
        control = by_name.get(c["control"], {}).get("monitored", {})
        twin = r.get("twin")
        twin_s = fmt_loss(twin["val_loss"]) if twin else "= (no action changed the run)"
        outcome = fmt_loss(mon["val_loss"])
        if r["run"]["rc"] == 3:
            outcome = f"halted @{mon['steps_done']}"
        if mon["rollbacks"]:
            outcome += f" ({mon['rollbacks']} rollback{'s' if mon['rollbacks'] > 1 else ''})"
        if c["kind"] == "healthy":
            det = det if first else "none (goal)"
            twin_s, lead = "", "-"
        rows.append(
            f"| {c['name']} | {c['what']} | {det} | {vis_s} | {lead} | {others or '-'} | "
            f"{outcome} / {twin_s} / {fmt_loss(control.get('val_loss'))} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=REPO / "runs" / "instab")
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    ap.add_argument("--prepare-only", action="store_true", help="build the data and stop")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    c0 = os.times()
    data = build(DATA)
    cases = [c for c in CASES if not a.cases or c.name in a.cases]
    unknown = set(a.cases or []) - {c.name for c in CASES}
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}; choose from {[c.name for c in CASES]}")
    if a.prepare_only:
        print(f"data ready in {data}")
        return 0
    print(f"{len(cases)} cases, {a.jobs} at a time, in {a.root}", flush=True)
    # Healthy controls first: the failures are compared with them.
    controls: dict = {}
    healthy = [c for c in cases if c.kind == "healthy"]
    failures = [c for c in cases if c.kind != "healthy"]
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda c: run_case(c, a.root, data, controls), healthy))
        results += list(pool.map(lambda c: run_case(c, a.root, data, controls), failures))
    order = {c.name: i for i, c in enumerate(CASES)}
    results.sort(key=lambda r: order[r["case"]["name"]])
    c1 = os.times()
    cpu = sum(r["run"]["cpu_s"] + r.get("twin_run", {}).get("cpu_s", 0.0) for r in results)
    cpu += (c1.user - c0.user) + (c1.system - c0.system)  # this process: data prep, reading
    wall = time.perf_counter() - t0
    md = table(results)
    head = (
        f"Measured on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), "
        f"{len(results)} cases + {sum('twin' in r for r in results)} log-only twins: "
        f"{wall:.0f} s wall, {cpu:.0f} CPU s (user+sys)."
    )
    (a.root / "table.md").write_text(head + "\n\n" + md + "\n")
    for r in results:  # the trajectories are in the run folders
        for key in ("monitored", "twin"):
            r.get(key, {}).pop("first_pass", None)
    (a.root / "results.json").write_text(
        json.dumps({"wall_s": wall, "cpu_s": cpu, "results": results}, indent=1, default=str)
    )
    print("\n" + head + "\n\n" + md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
