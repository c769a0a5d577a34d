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
import sys
from engine_jobs import sleep_marked
from data.engine.local import run_pool
if __name__ == "__main__":
    pids = open(sys.argv[1], "w")
    def started(pid):
        pids.write(f"{pid}\\n")
        pids.flush()
    try:
        for _ in run_pool(sleep_marked, [(sys.argv[2], float(sys.argv[3]))] * 4, 2, on_start=started):
            pass
    except KeyboardInterrupt:
        sys.exit(130)
"""


def _start_pool(tmp_path, seconds: float, *, until_running: bool):
    """A pool of 2 workers on jobs that sleep ``seconds``; returns once both have started (and,
    with ``until_running``, taken a job), with the process and the workers' pids."""
    script, pids, running = tmp_path / "pool.py", tmp_path / "pids", tmp_path / "running"
    script.write_text(WORKERS_SCRIPT)
    running.mkdir()
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(script), str(pids), str(running), str(seconds)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        started = pids.exists() and len(pids.read_text().split()) == 2
        if started and (not until_running or len(list(running.iterdir())) == 2):
            break
        time.sleep(0.01)
    return proc, [int(p) for p in pids.read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 30
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(map(_gone, pids))


def test_ctrl_c_while_workers_start_stops_them_without_a_traceback(tmp_path):
    """Ctrl-C reaches the process group while the workers are still importing: the parent stops
    them, none is left running and none prints a KeyboardInterrupt traceback."""
    proc, pids = _start_pool(tmp_path, 30, until_running=False)
    time.sleep(0.2)  # past the interpreter's start, into the imports (about a second)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and _wait_gone(pids)
    assert "Traceback" not in err, err


def test_workers_of_a_killed_parent_leave_quietly(tmp_path):
    """kill -9 of the parent: each worker ends its job, finds the pipe closed and leaves without
    a BrokenPipeError traceback."""
    proc, pids = _start_pool(tmp_path, 1.0, until_running=True)
    proc.kill()
    assert _wait_gone(pids)
    assert "Traceback" not in proc.stderr.read()
