"""One live run per run folder (train/run_lock.py), with real processes: a live holder refuses a
second taker by name; a holder killed with -9 leaves a stale lock that the next run takes over."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys

import pytest

from train.run_lock import RunLock, RunLocked, pid_alive, process_start

HOLD = """
import sys, time
from pathlib import Path
from train.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_holder_refuses_and_a_killed_one_leaves_a_stale_lock(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked, match=f"in use by a live run: pid {holder.pid} on host"):
            RunLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.INFO, logger="train.run_lock"):
        lock.acquire()  # the kernel released the dead holder's flock: stale, taken over
    assert f"pid {holder.pid}" in caplog.text and "stale" in caplog.text
    assert str(os.getpid()) in (tmp_path / "run.lock").read_text()
    lock.release()
    assert (tmp_path / "run.lock").read_text() == ""  # emptied, never deleted
    again = RunLock(tmp_path)
    again.acquire()  # a cleanly released lock: nothing to say
    again.release()


# The holder forks a child (as the loader forks its workers) that outlives it
HOLD_AND_FORK = """
import os, sys, time
from pathlib import Path
from train.run_lock import RunLock
RunLock(Path(sys.argv[1])).acquire()
if os.fork() == 0:
    print(os.getpid(), flush=True)  # after the fork's hooks have run in this child
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_a_child_forked_from_the_holder_does_not_keep_the_lock_after_it_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child = int(holder.stdout.readline())
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert pid_alive(child, None)
        lock = RunLock(tmp_path)
        lock.acquire()  # the dead holder's lock, although its child still runs
        lock.release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_pid_checks_for_filesystems_without_flock():
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)
    assert not pid_alive(dead, None)  # reaped: no such process (pids are not reused this fast)
    me, start = os.getpid(), process_start(os.getpid())
    assert start is not None and pid_alive(me, start)
    assert not pid_alive(me, start + 1)  # same pid, another process start: a reused pid


def test_a_run_dir_that_cannot_be_made_is_refused_by_name(tmp_path):
    """Before: Hydra made run_dir itself, and a file in its path was a traceback, exit code 1."""
    from trainrun import train

    (tmp_path / "afile").write_text("not a folder\n")
    with pytest.raises(RunLocked, match=r"run_dir .*afile/run cannot be used: Not a directory"):
        RunLock(tmp_path / "afile" / "run").acquire()
    p = train(["experiment=debug", f"run_dir={tmp_path / 'afile' / 'run'}"], check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "afile/run cannot be used: Not a directory" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_refused_run_leaves_no_folder_it_made(tmp_path):
    """A run refused after it took the lock (a config checked at start) left an empty run folder
    holding run.lock; one it did not make, or that holds anything else, keeps its run.lock."""
    made = tmp_path / "new" / "run"
    lock = RunLock(made)
    lock.acquire()
    lock.release()
    assert not made.exists() and (tmp_path / "new").is_dir()
    lock = RunLock(tmp_path)  # a folder that was there
    lock.acquire()
    lock.release()
    assert (tmp_path / "run.lock").read_text() == ""
    lock = RunLock(made)
    lock.acquire()
    (made / "metrics.jsonl").write_text("")
    lock.release()
    assert (made / "run.lock").read_text() == ""


def test_a_lock_taken_on_a_file_removed_meanwhile_is_taken_again(tmp_path, monkeypatch):
    """A refused run removes its empty folder's run.lock while holding it: a process that had
    opened that file before and flocks it after holds an orphan, which locks nothing."""
    lock = RunLock(tmp_path / "run")
    real_flock, calls = fcntl.flock, []

    def flock_after_removal(fd, op):
        if not calls:  # as if the refused run removed the file between open and flock
            (tmp_path / "run" / "run.lock").unlink()
        calls.append(fd)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_removal)
    lock.acquire()
    assert len(calls) >= 2 and (tmp_path / "run" / "run.lock").is_file()
    assert lock._still_at_path(lock.fd)
    lock.release()
