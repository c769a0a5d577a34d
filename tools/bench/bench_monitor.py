"""Monitor overhead: the time the monitors take per step as a fraction of the step.

Runs ``earlyfuse-train experiment=demo`` (the demo's 2.6M-parameter model on the demo's token
shards, with its validation set as the probe rows; ``make demo`` first) twice in this command: with the default monitors (every detector, the three probes every 100
steps) and with ``monitor.enabled=false``. In the monitored run, every step logs
``throughput/monitor_s`` (detectors + that step's probes, timed inside the run) beside
``throughput/step_s`` (forward, backward, update); the overhead is their ratio over all steps.
The unmonitored run's mean step time is printed beside it as a check that the monitors do not
slow the step itself.

    .venv/bin/python tools/bench/bench_monitor.py [--steps 300] [--experiment demo]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from train.names import METRICS_FILE


def run(experiment: str, out: Path, steps: int, *extra: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "train.app",
        f"experiment={experiment}",
        f"run_dir={out}",
        f"train.steps={steps}",
        "train.log_every=100",
        "train.eval_every=0",
        "train.ckpt_every=0",
        "train.progress=false",
        "train.tensorboard=false",
        *extra,
    ]
    subprocess.run(
        cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--experiment", default="demo")
    args = parser.parse_args(argv)
    if args.experiment == "demo" and not Path("runs/demo/tokens/text").is_dir():
        sys.exit("runs/demo/tokens: no token shards; run `make demo` first (or pass --experiment)")
    with tempfile.TemporaryDirectory() as tmp:
        on_recs = run(args.experiment, Path(tmp) / "on", args.steps)
        off_recs = run(args.experiment, Path(tmp) / "off", args.steps, "monitor.enabled=false")
    step_s = sum(rec["throughput/step_s"] for rec in on_recs)
    mon_s = sum(rec["throughput/monitor_s"] for rec in on_recs)
    probe_steps = [rec for rec in on_recs if "monitor/attn_max_logit" in rec]
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "steps": args.steps,
        "mean_step_s": step_s / len(on_recs),
        "mean_monitor_s": mon_s / len(on_recs),
        "monitor_fraction": mon_s / step_s,
        "probe_step_monitor_s": sum(rec["throughput/monitor_s"] for rec in probe_steps)
        / max(1, len(probe_steps)),
        "detector_only_monitor_s": (
            sum(rec["throughput/monitor_s"] for rec in on_recs if rec not in probe_steps)
            / max(1, len(on_recs) - len(probe_steps))
        ),
        "mean_step_s_monitor_off": sum(rec["throughput/step_s"] for rec in off_recs)
        / len(off_recs),
        "monitor_s_when_off": sum(rec["throughput/monitor_s"] for rec in off_recs) / len(off_recs),
    }
    print(
        f"monitor overhead: {res['monitor_fraction']:.2%} of step time (target <= 2%) over {args.steps} steps; "
        f"step {res['mean_step_s'] * 1e3:.1f} ms (monitors off: {res['mean_step_s_monitor_off'] * 1e3:.1f} ms); "
        f"detectors {res['detector_only_monitor_s'] * 1e3:.2f} ms/step, a probe step "
        f"{res['probe_step_monitor_s'] * 1e3:.0f} ms"
    )
    res["probe_s"] = {
        key.rsplit("/", 1)[1]: sum(rec[key] for rec in probe_steps) / len(probe_steps)
        for key in sorted(
            {key for rec in probe_steps for key in rec if key.startswith("throughput/probe_s/")}
        )
    }
    print(
        "per probe (s): " + ", ".join(f"{key} {value:.3f}" for key, value in res["probe_s"].items())
    )
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
