"""The monitors on real instabilities: recall, lead time, false alarms and recovery.

Every case (``cases.yaml``) is a real ``earlyfuse-train`` subprocess with the default monitors,
its failure from its config (``configs/experiment/``, found through ``SEARCHPATH``) or its data
(``data.py``); docs/monitors.md ("Measured on real instabilities") says what is measured and how.

    .venv/bin/python tools/monitor_eval/instability.py            # every case
    .venv/bin/python tools/monitor_eval/instability.py --cases lr-jump healthy-debug-0 --jobs 1
    .venv/bin/python tools/monitor_eval/instability.py --prepare-only  # only build the data
    .venv/bin/python tools/monitor_eval/instability.py --list          # the cases and their runs

The data is built once into runs/instab/data (the instab_* configs read it there); the runs go
to ROOT/runs (ROOT: runs/instab); ROOT/results.json and ROOT/table.md hold the results.
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

from tools.evaluate.table import fmt_figure  # noqa: E402
from tools.monitor_eval.cases import ACTING, CASES, LOG_ONLY, Case, mix_override  # noqa: E402
from tools.monitor_eval.data import build  # noqa: E402
from tools.report.lead import loss_above_control, loss_visible  # noqa: E402
from tools.report.run import NoMetrics, RunData, load_run  # noqa: E402

SEVERE = ("warn", "skip", "rollback", "halt")
DATA = REPO / "runs" / "instab" / "data"  # where the instab_* configs read it
# The cases' configs live beside the suite, not among the user's presets in configs/: Hydra finds
# them through an extra search path, so `experiment=instab_*` composes onto configs/ as usual.
CONFIGS = Path(__file__).resolve().parent / "configs"
SEARCHPATH = f"hydra.searchpath=[file://{CONFIGS}]"


def train_args(case: Case, run_dir: Path, data: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The ``earlyfuse-train`` overrides of one case's run."""
    return [
        SEARCHPATH,
        f"experiment={case.experiment}",
        f"run_dir={run_dir}",
        f"train.seed={case.seed}",
        f"data.seed={case.seed}",
        "train.progress=false",
        *(mix_override(case.mix, str(data.parent), validation=case.validation) if case.mix else []),
        *case.overrides,
        *extra,
    ]


def train(case: Case, run_dir: Path, data: Path, extra: tuple[str, ...] = ()) -> dict:
    """One ``earlyfuse-train`` subprocess (two for a case that is killed and resumed: the first
    dies like kill -9 after step ``resume_at``, the second resumes from its checkpoint); returns
    the exit code and CPU/wall seconds."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    args = train_args(case, run_dir, data, extra)
    runs = [[sys.executable, "-m", "train.app", *args]]
    if case.resume_at is not None:  # a preemption: the fault callback kills the process
        faults = ["--fault", f"kill_at_step={case.resume_at}"]
        runs.insert(
            0, [sys.executable, str(REPO / "tests" / "train_with_faults.py"), *faults, *args]
        )
    # one thread a run; where DeepSpeed's JIT-built ops go, the run decides (train/ds_env.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out: dict = {"rc": 0, "cpu_s": 0.0, "wall_s": 0.0, "cmd": " ".join(args)}
    started = time.perf_counter()
    for i, cmd in enumerate(runs):  # a resumed run appends to the killed one's logs
        with open(run_dir / "stdout.log", "a") as stdout, open(run_dir / "stderr.log", "a") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=err, env=env)
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own CPU time
        proc.returncode = out["rc"] = os.waitstatus_to_exitcode(status)
        out["cpu_s"] += usage.ru_utime + usage.ru_stime
        if i < len(runs) - 1:
            out["killed_rc"] = proc.returncode
    out["wall_s"] = time.perf_counter() - started
    return out


def read_run(run_dir: Path) -> dict:
    """What one run did: its alarms, the loss rule on its first pass, its final losses, read as
    earlyfuse-report reads a run (a run that logged nothing did nothing)."""
    try:
        run = load_run(run_dir)
    except NoMetrics:
        run = RunData(run_dir, run_dir.name, "lm", None, {}, {})
    tail = [run.records[step]["train/loss"] for step in run.steps[-20:]]
    out = (run_dir / "stdout.log").read_text() if (run_dir / "stdout.log").is_file() else ""
    vis = loss_visible(run.first_pass)
    return {
        "first_pass": run.first_pass,
        "alarms": run.alarms,
        "visible": None if vis is None else {"step": vis.step, "series": vis.series},
        "val_loss": run.final.get("val/loss"),
        "train_loss_last20": sum(tail) / len(tail) if tail else None,
        "rollbacks": out.count("ROLLBACK at step"),
        "steps_done": run.last_step,
    }


def summarize(case: Case, mon: dict, twin: dict | None, control: dict | None = None) -> dict:
    severe = [alarm for alarm in mon["alarms"] if alarm["action"] in SEVERE]
    early = [alarm for alarm in severe if case.onset is not None and alarm["step"] < case.onset]
    after = [alarm for alarm in severe if case.onset is None or alarm["step"] >= case.onset]
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
        "first": first
        and {key: first.get(key) for key in ("signal", "modality", "step", "action")},
        "before_onset": [
            (alarm["step"], alarm["signal"], alarm.get("modality")) for alarm in early
        ],
        "signals": sorted({(alarm["signal"], alarm.get("modality") or "") for alarm in severe}),
        "visible": vis,
        "lead": lead,
        "actions": sorted({alarm["action"] for alarm in severe}),
    }


def run_case(case: Case, root: Path, data: Path, controls: dict) -> dict:
    rec: dict = {"case": case.__dict__ | {"overrides": list(case.overrides)}}
    rec["run"] = train(case, root / "runs" / case.name, data)
    rec["monitored"] = read_run(root / "runs" / case.name)
    acted = (
        any(alarm["action"] in ACTING for alarm in rec["monitored"]["alarms"])
        or rec["run"]["rc"] == 3
    )
    if case.kind == "failure" and acted:
        rec["twin_run"] = train(case, root / "runs" / f"{case.name}-log", data, LOG_ONLY)
        rec["twin"] = read_run(root / "runs" / f"{case.name}-log")
    rec["summary"] = summarize(case, rec["monitored"], rec.get("twin"), controls.get(case.control))
    if case.kind == "healthy":
        controls[case.name] = rec["monitored"]
    first = rec["summary"]["first"]
    det = f"{first['signal']}@{first['step']}" if first else "none"
    visible = rec["summary"]["visible"]
    rc = rec["run"]["rc"]
    print(f"  done {case.name}: first alarm {det}, loss visible {visible}, rc {rc}", flush=True)
    return rec


def table(results: list[dict]) -> str:
    by_name = {result["case"]["name"]: result for result in results}
    rows = [
        "| case | what | first warn+ alarm (step, action) | loss visible (rule) | lead | "
        "other signals | final val loss: monitors / log only / healthy |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        case, summary, mon = result["case"], result["summary"], result["monitored"]
        first = summary["first"]
        det = (
            f"{first['signal']}{'[' + first['modality'] + ']' if first['modality'] else ''} "
            f"@{first['step']} ({first['action']})"
            if first
            else "**none**"
        )
        vis = summary["visible"]
        vis_s = f"{vis['step']} ({vis['series']})" if vis else "never"
        lead = "-" if summary["lead"] is None else f"{summary['lead']:+d}"
        others = ", ".join(
            f"{sig}{'[' + modality + ']' if modality else ''}"
            for sig, modality in summary["signals"]
        )
        if summary["before_onset"]:
            others += f"; **{len(summary['before_onset'])} before onset**"
        control = by_name.get(case["control"], {}).get("monitored", {})
        twin = result.get("twin")
        twin_s = fmt_figure(twin["val_loss"]) if twin else "= (no action changed the run)"
        outcome = fmt_figure(mon["val_loss"])
        if result["run"]["rc"] == 3:
            outcome = f"halted @{mon['steps_done']}"
        if mon["rollbacks"]:
            outcome += f" ({mon['rollbacks']} rollback{'s' if mon['rollbacks'] > 1 else ''})"
        if case["kind"] == "healthy":
            det = det if first else "none (goal)"
            twin_s, lead = "", "-"
        rows.append(
            f"| {case['name']} | {case['what']} | {det} | {vis_s} | {lead} | {others or '-'} | "
            f"{outcome} / {twin_s} / {fmt_figure(control.get('val_loss'))} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "instab")
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=[case.name for case in CASES],
        metavar="CASE",
        help="case names (default: all)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--prepare-only", action="store_true", help="build the data and stop")
    parser.add_argument(
        "--list", action="store_true", help="print each case's earlyfuse-train command, run nothing"
    )
    args = parser.parse_args(argv)
    cases = [case for case in CASES if not args.cases or case.name in args.cases]
    if args.list:
        for case in cases:
            run_args = train_args(case, args.root / "runs" / case.name, DATA / "suite")
            print(f"{case.name} ({case.kind}): earlyfuse-train {' '.join(run_args)}")
        return 0
    started = time.perf_counter()
    own_cpu = sum(os.times()[:2])  # this process's user + sys: data prep, reading
    data = build(DATA)
    if args.prepare_only:
        print(f"data ready in {data}")
        return 0
    print(f"{len(cases)} cases, {args.jobs} at a time, in {args.root}", flush=True)
    # Healthy controls first: the failures are compared with them.
    controls: dict = {}
    healthy = [case for case in cases if case.kind == "healthy"]
    failures = [case for case in cases if case.kind != "healthy"]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda case: run_case(case, args.root, data, controls), healthy))
        results += list(pool.map(lambda case: run_case(case, args.root, data, controls), failures))
    order = {case.name: i for i, case in enumerate(CASES)}
    results.sort(key=lambda result: order[result["case"]["name"]])
    cpu = sum(os.times()[:2]) - own_cpu
    cpu += sum(run["run"]["cpu_s"] + run.get("twin_run", {}).get("cpu_s", 0.0) for run in results)
    wall = time.perf_counter() - started
    markdown = table(results)
    head = (
        f"Measured on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), "
        f"{len(results)} cases + {sum('twin' in result for result in results)} log-only twins: "
        f"{wall:.0f} s wall, {cpu:.0f} CPU s (user+sys)."
    )
    (args.root / "table.md").write_text(head + "\n\n" + markdown + "\n")
    for result in results:  # the trajectories are in the run folders
        for key in ("monitored", "twin"):
            result.get(key, {}).pop("first_pass", None)
    (args.root / "results.json").write_text(
        json.dumps({"wall_s": wall, "cpu_s": cpu, "results": results}, indent=1, default=str)
    )
    print("\n" + head + "\n\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
