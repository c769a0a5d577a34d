"""The local engine: long-lived workers, recycled only after failed video decodes (decord leaks
~40 KB per failure), a dead worker's job retried, a job's own error raised with its traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_jobs import die_once, failing_decodes, raise_value_error

from data.engine.local import RemoteTraceback, run_local, run_pool
from data.media import decode_failures


def test_workers_live_across_jobs_and_are_recycled_after_failed_decodes():
    started: list[int] = []
    # Clean jobs: one worker does them all (the old pool replaced it every 8 jobs).
    pids = list(run_pool(failing_decodes, [0] * 12, 1, recycle_after=5, on_start=started.append))
    assert len(set(pids)) == 1 and len(started) == 1
    # 3 failed decodes per job, recycled at 5: each worker does two jobs, then a fresh one starts.
    started.clear()
    pids = list(run_pool(failing_decodes, [3] * 6, 1, recycle_after=5, on_start=started.append))
    assert len(started) == 3
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] == pids[5]


def test_inline_run_moves_to_a_recycled_worker_once_this_process_has_failed_enough():
    import os

    before = decode_failures()
    pids = list(run_local(failing_decodes, [2] * 4, 1, recycle_after=3))
    assert decode_failures() - before == 4  # two inline jobs, then the parent stops decoding
    assert pids[:2] == [os.getpid()] * 2 and os.getpid() not in pids[2:]


def test_a_dead_workers_job_is_retried_on_a_fresh_worker(tmp_path):
    started: list[int] = []
    marker = str(tmp_path / "died")
    got = list(run_pool(die_once, [marker], 2, on_start=started.append))
    assert got == ["survived"] and len(started) == 2


def test_a_jobs_own_error_stops_the_run_with_the_workers_traceback():
    with pytest.raises(ValueError, match=r"job [12] is bad input") as info:
        list(run_pool(raise_value_error, [1, 2], 2))
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "raise_value_error" in str(info.value.__cause__)


def test_the_workers_flag_refuses_zero_and_says_when_it_is_more_than_the_cpus(tmp_path, capsys):
    from data.cli import main
    from data.engine.local import cpu_count

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some prose")
    args = ["ingest", "--out", str(tmp_path / "out"), "--source", f"text:{tmp_path / 'src'}"]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--workers", "0"])
    assert exit_info.value.code == 2
    assert "--workers: 0 is not a count" in capsys.readouterr().err
    assert main(args + ["--no-progress", "--workers", str(cpu_count() + 1)]) == 0
    assert f"--workers {cpu_count() + 1} is more than the {cpu_count()} CPU(s)" in (
        capsys.readouterr().err
    )


WORKERS_SCRIPT = """
import sys, time
from data.engine.local import run_pool
if __name__ == "__main__":
    pids = open(sys.argv[1], "w")
    def started(pid):
        pids.write(f"{pid}\\n")
        pids.flush()
    for _ in run_pool(time.sleep, [float(sys.argv[2])] * 4, 2, on_start=started):
        pass
"""


def _start_pool(tmp_path, seconds: float):
    script = tmp_path / "pool.py"
    script.write_text(WORKERS_SCRIPT)
    pids = tmp_path / "pids"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pids), str(seconds)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    for _ in range(600):
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.05)
    time.sleep(1.0)  # the workers have imported and taken their first job
    return proc, [int(p) for p in pids.read_text().split()]


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_ctrl_c_stops_the_workers_with_the_parent(tmp_path):
    """Ctrl-C reaches the process group: the parent stops its workers, none is left running."""
    proc, pids = _start_pool(tmp_path, 30)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids))


def test_workers_of_a_killed_parent_leave_quietly(tmp_path):
    """kill -9 of the parent: each worker ends its job, finds the pipe closed and leaves without
    a BrokenPipeError traceback."""
    proc, pids = _start_pool(tmp_path, 1.5)
    proc.kill()
    deadline = time.monotonic() + 15
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids))
    assert "Traceback" not in proc.stderr.read()
