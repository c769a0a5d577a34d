"""The benchmarks in tools/bench/ and the monitors' evaluation in tools/monitor_eval/ are scripts
of a checkout, not part of the installed distribution: `pip install earlyfuse` leaves them out,
and each runs as `python tools/bench/X.py` with `--help`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    *sorted(p for p in (ROOT / "tools" / "bench").glob("*.py") if p.name != "__init__.py"),
    ROOT / "tools" / "monitor_eval" / "instability.py",
]


def test_the_distribution_leaves_the_benchmarks_out():
    # setuptools' own reading of pyproject.toml, its package find expanded as a build does it.
    shipped = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"]
    assert {"data", "model", "train", "tools", "tools.evaluate", "tools.report"} <= set(shipped)
    assert not [name for name in shipped if name.startswith(("tools.bench", "tools.monitor_eval"))]


def test_every_benchmark_script_answers_help():
    """One fresh interpreter runs every script as `__main__` with `--help` (one torch import for
    all of them, not one per script): each must print its usage and exit 0 from the checkout."""
    driver = textwrap.dedent(
        """
        import contextlib, io, runpy, sys
        failed = []
        for path in sys.argv[1:]:
            sys.argv = [path, "--help"]
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    runpy.run_path(path, run_name="__main__")
                code = "returned without printing its usage"
            except SystemExit as stop:
                code = stop.code
            if code not in (0, None) or "usage:" not in out.getvalue():
                failed.append(f"{path}: exit {code!r}")
        print("\\n".join(failed) or "all answered")
        """
    )
    assert len(SCRIPTS) >= 10
    proc = subprocess.run(
        [sys.executable, "-c", driver, *map(str, SCRIPTS)],
        cwd="/",  # as from anywhere: the scripts do not rely on the working directory
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "all answered", proc.stdout[-3000:]
