"""Monitor overhead (issue 7): the time the monitors take per step as a fraction of the step.

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
    return [json.loads(x) for x in (out / METRICS_FILE).read_text().splitlines()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--experiment", default="demo")
    a = ap.parse_args(argv)
    if a.experiment == "demo" and not Path("runs/demo/tokens/text").is_dir():
        sys.exit("runs/demo/tokens: no token shards; run `make demo` first (or pass --experiment)")
    with tempfile.TemporaryDirectory() as tmp:
        on = run(a.experiment, Path(tmp) / "on", a.steps)
        off = run(a.experiment, Path(tmp) / "off", a.steps, "monitor.enabled=false")
    step_s = sum(r["throughput/step_s"] for r in on)
    mon_s = sum(r["throughput/monitor_s"] for r in on)
    probe_steps = [r for r in on if "monitor/attn_max_logit" in r]
    res = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "steps": a.steps,
        "mean_step_s": step_s / len(on),
        "mean_monitor_s": mon_s / len(on),
        "monitor_fraction": mon_s / step_s,
        "probe_step_monitor_s": sum(r["throughput/monitor_s"] for r in probe_steps)
        / max(1, len(probe_steps)),
        "detector_only_monitor_s": (
            sum(r["throughput/monitor_s"] for r in on if r not in probe_steps)
            / max(1, len(on) - len(probe_steps))
        ),
        "mean_step_s_monitor_off": sum(r["throughput/step_s"] for r in off) / len(off),
        "monitor_s_when_off": sum(r["throughput/monitor_s"] for r in off) / len(off),
    }
    print(
        f"monitor overhead: {res['monitor_fraction']:.2%} of step time (target <= 2%) over {a.steps} steps; "
        f"step {res['mean_step_s'] * 1e3:.1f} ms (monitors off: {res['mean_step_s_monitor_off'] * 1e3:.1f} ms); "
        f"detectors {res['detector_only_monitor_s'] * 1e3:.2f} ms/step, a probe step "
        f"{res['probe_step_monitor_s'] * 1e3:.0f} ms"
    )
    res["probe_s"] = {
        k.rsplit("/", 1)[1]: sum(r[k] for r in probe_steps) / len(probe_steps)
        for k in sorted({k for r in probe_steps for k in r if k.startswith("throughput/probe_s/")})
    }
    print("per probe (s): " + ", ".join(f"{k} {v:.3f}" for k, v in res["probe_s"].items()))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
