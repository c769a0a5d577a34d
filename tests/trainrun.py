"""Run ``earlyfuse-train`` in a subprocess, as a user would, and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ray_cluster import free_port

FAULT_ENTRY = Path(__file__).with_name("train_with_faults.py")


def file_size_limited(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess``: the child may write at most ``limit`` bytes into one
    file (``ulimit -f``); a write past it fails with EFBIG, as one on a full disk fails with
    ENOSPC (SIGXFSZ, which would kill the child, is ignored)."""

    def limit_file_size() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_file_size


def run_checkout(cmd: list[str], *, file_size_limit: int | None = None):
    """``cmd`` in a subprocess that imports this checkout's code (PYTHONPATH), its output
    captured; ``file_size_limit``: as ``file_size_limited``."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        preexec_fn=file_size_limited(file_size_limit) if file_size_limit else None,
    )


def train(
    overrides: list[str],
    *,
    env: dict | None = None,
    check: bool = True,
    nproc: int = 1,
    timeout: int = 600,
    faults: dict | None = None,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """``faults``: {name: value} of train/callbacks/faults.py, injected through the test entry
    point tests/train_with_faults.py (a normal run never registers them). ``file_size_limit``:
    the most bytes the run may write into one file (``ulimit -f``; a write past it fails with
    EFBIG, as on a full disk, SIGXFSZ being ignored)."""
    entry = ["-m", "train.app"]
    if faults:
        entry = [str(FAULT_ENTRY)] + [f"--fault={k}={v}" for k, v in faults.items()]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            *entry,
        ]
    else:
        cmd = [sys.executable, *entry]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(
        cmd + overrides + ["train.progress=false"],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        preexec_fn=file_size_limited(file_size_limit) if file_size_limit else None,
    )
    if check and p.returncode != 0:
        raise AssertionError(
            f"earlyfuse-train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
        )
    return p


def release_debug_run(tokens: Path, root: Path, sources: tuple[str, ...], *extra: str) -> Path:
    """Four steps of the debug LM on ``sources`` (token folders under ``tokens``) with the
    ``extra`` overrides, released into ``root / "rel"``."""
    from tools.convert_release import make_release

    srcs = ",".join(f"{{name: {s}, shards: [{tokens / s}], weight: 1.0}}" for s in sources)
    train(
        [
            "experiment=debug",
            f"data.sources=[{srcs}]",
            f"run_dir={root / 'run'}",
            "train.steps=4",
            "train.micro_batch=2",
            *extra,
        ]
    )
    make_release(root / "run", root / "rel", log=lambda *a, **k: None)
    return root / "rel"


def metrics(run_dir: Path) -> dict[int, dict]:
    """The last record logged for each step (a resumed run logs some steps twice)."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec
    return out


def rng_digests(path: Path, *, rank: int = 0, every: bool = False):
    """The RNG digests a run logged before each step (fault ``rng_log``): {step: digest}, or with
    ``every`` all (step, digest) pairs in order (a killed and resumed run logs some steps twice)."""
    pairs = [
        (int(step), digest)
        for step, digest in (ln.split() for ln in Path(f"{path}.{rank}").read_text().splitlines())
    ]
    return pairs if every else dict(pairs)
