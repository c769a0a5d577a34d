"""Run ``earlyfuse-train`` in a subprocess, as a user would, and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def train(
    overrides: list[str],
    *,
    env: dict | None = None,
    check: bool = True,
    nproc: int = 1,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(29500 + os.getpid() % 1000),
            "-m",
            "train.app",
        ]
    else:
        cmd = [sys.executable, "-m", "train.app"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(
        cmd + overrides + ["train.progress=false"],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"earlyfuse-train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        )
    return p


def metrics(run_dir: Path) -> dict[int, dict]:
    """The last record logged for each step (a resumed run logs some steps twice)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out
