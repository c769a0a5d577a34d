"""The guide's timings: docs/own_data.md's CPU try, run as the page writes it, wall and CPU time
per command.

    .venv/bin/python tools/bench/guide_timings.py [--threads 1] [--out timings.json]

The commands, the corpus (``--scale`` times the test's documents; 3: 376 documents) and the
local S3-compatible server are the slow guide test's (tests/guide_run.py, tests/s3_server.py:
test dependencies, ``pip install -e '.[test]'``). The two training runs take their presets' own
step counts, validations, checkpoints and monitors included. ``--vtok-steps`` and ``--lm-steps``
cut them (``train.steps=N`` appended: Hydra takes a key's last value) for a quicker estimate:
the cut run plus the remaining steps at the rate between its first and last console lines. A
cut shorter than the preset's ``eval_every`` leaves its validations out of that rate.

Wall time is the command's; CPU time is user + system of the command and every process it
started: on a shared machine wall time grows with the others' load, CPU time much less.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench import process_tree  # noqa: E402

# A training run's console line (train/callbacks/metrics_log.py): "step 25/100 | loss ...".
STEP_LINE = re.compile(r"\bstep (\d+)/(\d+) \|")


@dataclass
class Timing:
    command: str
    wall_s: float
    cpu_s: float
    # Training runs: the steps run, the rate between the first and last console lines and the
    # preset's own step count, measured (the whole preset ran) or estimated (a cut run).
    steps: int = 0
    per_100_wall_s: float = 0.0
    per_100_cpu_s: float = 0.0
    preset_steps: int = 0
    preset_wall_s: float = 0.0
    preset_cpu_s: float = 0.0
    marks: list[tuple[int, float, float]] = field(default_factory=list)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu(pid: int) -> float:
    """User + system seconds of a live process and all its descendants (with the children each
    has waited for), from Linux's /proc."""
    ticks = 0
    for proc in process_tree(pid):
        try:
            # Fields after the command name (which may hold spaces), from ")": state, ppid, ...
            fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended while we looked
        ticks += sum(int(tick) for tick in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def preset_steps(line: str) -> int:
    """``train.steps`` of the experiment preset a training command names."""
    for word in shlex.split(line):
        if word.startswith("experiment="):
            preset = ROOT / "configs" / "experiment" / f"{word.split('=', 1)[1]}.yaml"
            return int(yaml.safe_load(preset.read_text())["train"]["steps"])
    raise ValueError(f"no experiment= in {line!r}")


def run_line(timings: list[Timing], line: str, script: str, env: dict[str, str]) -> str:
    """Run one of the guide's lines (``script``: it, after the page's `export` lines) and time it
    into ``timings``; its output is echoed as it comes."""
    print(f"\n$ {line}", flush=True)
    cpu_before, start = children_cpu(), time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=env["HOME"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    said, marks = [], []
    for out in proc.stdout:
        said.append(out)
        print("  " + out, end="", flush=True)
        found = STEP_LINE.search(out)
        if found:
            marks.append((int(found[1]), time.monotonic() - start, tree_cpu(proc.pid)))
    code = proc.wait()
    timing = Timing(line, time.monotonic() - start, children_cpu() - cpu_before)
    if code != 0:
        raise SystemExit(f"`{line}` exited with status {code}")
    if line.startswith("earlyfuse-train") and len(marks) >= 2:
        rate(timing, marks, preset_steps(line))
    timings.append(timing)
    return "".join(said)


def rate(timing: Timing, marks: list[tuple[int, float, float]], preset: int) -> None:
    (first, wall0, cpu0), (last, wall1, cpu1) = marks[0], marks[-1]
    timing.steps, timing.marks, timing.preset_steps = last, marks, preset
    timing.per_100_wall_s = (wall1 - wall0) * 100 / (last - first)
    timing.per_100_cpu_s = (cpu1 - cpu0) * 100 / (last - first)
    more = max(0, preset - last) / 100
    timing.preset_wall_s = timing.wall_s + more * timing.per_100_wall_s
    timing.preset_cpu_s = timing.cpu_s + more * timing.per_100_cpu_s


def table(timings: list[Timing]) -> str:
    rows = ["| command | wall | CPU (user+sys) |", "|---|---|---|"]
    for timing in timings:
        command = timing.command if len(timing.command) <= 70 else timing.command[:67] + "..."
        rows.append(f"| `{command}` | {timing.wall_s:.0f} s | {timing.cpu_s:.0f} s |")
        if timing.steps:
            rows.append(
                f"| ... per 100 steps | {timing.per_100_wall_s:.0f} s | "
                f"{timing.per_100_cpu_s:.0f} s |"
            )
            how = "measured" if timing.steps >= timing.preset_steps else "estimated"
            rows.append(
                f"| ... {timing.preset_steps} steps (the preset's; {how}) | "
                f"{timing.preset_wall_s:.0f} s | {timing.preset_cpu_s:.0f} s |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=int, default=3, help="times the test corpus's documents")
    parser.add_argument("--vtok-steps", type=int, help="cut the visual tokenizer's run")
    parser.add_argument("--lm-steps", type=int, help="cut the language model's run")
    parser.add_argument(
        "--threads",
        help="OMP_NUM_THREADS of the commands (default: this environment's, else torch's own "
        "choice, one per core, as a user's commands get)",
    )
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    parser.add_argument("--out", type=Path, help="also write the timings here (JSON)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    guide_run = importlib.import_module("guide_run")
    s3_server = importlib.import_module("s3_server")
    with tempfile.TemporaryDirectory(prefix="guide_timings_") as scratch:
        home = args.keep or Path(scratch)
        home.mkdir(parents=True, exist_ok=True)
        guide_run.write_user_configs(home)
        files = guide_run.build_corpus(home, scale=args.scale)
        load_before = os.getloadavg()
        cut = {"vtok_demo": args.vtok_steps, "demo": args.lm_steps}
        extra = {
            f"experiment={preset}": (f" train.steps={steps}" if steps is not None else "")
            + " train.progress=false"
            for preset, steps in cut.items()
        }
        timings: list[Timing] = []
        run = partial(run_line, timings)
        with s3_server.s3_with_bucket(guide_run.BUCKET) as server:
            guide_run.upload(files)
            guide_run.run_recipe(home, server.env, extra=extra, run=run, threads=args.threads)
        load_after = os.getloadavg()
    print(f"\n{table(timings)}\n")
    threads = args.threads or os.environ.get("OMP_NUM_THREADS") or "torch's default"
    print(
        f"{os.cpu_count()} cores, OMP_NUM_THREADS {threads}; load average (1, 5, 15 min) before "
        + ", ".join(f"{load:.1f}" for load in load_before)
        + ", after "
        + ", ".join(f"{load:.1f}" for load in load_after)
    )
    if args.out:
        record = {
            "scale": args.scale,
            "threads": os.environ.get("OMP_NUM_THREADS") if args.threads is None else args.threads,
            "cores": os.cpu_count(),
            "load_before": load_before,
            "load_after": load_after,
            "timings": [asdict(timing) for timing in timings],
        }
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
