"""One live run per run folder: ``RUN_DIR/run.lock``.

Rank 0 holds an exclusive ``flock`` on the file for the whole run and writes into it its host,
pid, the process's start time and the moment it started. A second run on the same folder fails
to take the lock and is refused with a message naming the holder; the other ranks of that second
run learn it through a collective and stop too.

Design choices:
- ``flock`` is released by the kernel when its process dies, however it dies (kill -9 included),
  so a lock left by a crashed run is recognised as stale without guessing; the file then still
  names the dead process, and the new run says it takes over. On a shared filesystem whose flock
  is coherent across hosts (NFSv4, GPFS, Lustre mounted with ``-o flock``) this holds across
  nodes too.
- Where ``flock`` is not supported (some network filesystems answer ENOLCK or ENOSYS), the file's
  contents decide: a holder on this host whose pid is gone (or belongs to a process started at
  another time: a reused pid) is stale; a holder on another host cannot be checked from here and
  is refused with the command that removes the lock.
- The file is never deleted, only emptied when the run ends: deleting it would let a process that
  opened the old file and one that creates a new one both hold "the" lock. Except in a folder
  this run made and left empty (a run refused before it wrote anything): the folder goes too,
  while the lock is still held, so a refused command leaves no run folder behind; a process
  whose flock then succeeds checks that it locked the file still at the path, and takes the
  lock again if not.
- A process forked from the holder (the loader's DataLoader workers fork from the trainer's
  process) closes its copy of the descriptor at once: the flock belongs to the open file, so a
  copy would keep the folder locked after the holder died, for as long as the child lives.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from data.shards.storage import process_exists

log = logging.getLogger(__name__)
LOCK_NAME = "run.lock"


_held: set[RunLock] = set()  # the locks this process holds (released ones leave)


def _close_in_child() -> None:
    for lock in list(_held):
        if lock.fd is not None:
            os.close(lock.fd)  # the child's copy only: the holder's lock stays (no LOCK_UN here)
            lock.fd = None  # nothing left for the child to release
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLocked(RuntimeError):
    """Another live run holds the run folder."""


class RunFolderUnusable(RunLocked):
    """The run folder cannot be made or written: nothing can be locked, nothing was started."""


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is the process that started at ``start`` (not one that reuses its PID)."""
    if not process_exists(pid):
        return False
    now = process_start(pid)
    return start is None or now is None or now == start


def holder_text(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"


def live_holder(run_dir: Path) -> dict | None:
    """The run training in ``run_dir`` now, as its lock names it (None: none, or one that is
    gone). Read, not locked: a check must not refuse a run that starts meanwhile. A holder on
    another host cannot be checked from here and counts as live."""
    holder = RunLock(run_dir).read_holder()
    if not holder.get("pid"):
        return None  # emptied by a run that ended, or never taken
    if holder.get("host") != socket.gethostname():
        return holder
    return holder if pid_alive(int(holder["pid"]), holder.get("start")) else None


class _Orphaned(Exception):
    """The file this process locked is no longer the one at the lock's path."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None
        self.made_folder = False

    def read_holder(self) -> dict:
        try:
            text = self.path.read_text()
            return json.loads(text) if text.strip() else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        try:
            self.made_folder = not self.path.parent.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a file in the way, no permission, a read-only filesystem
            raise RunFolderUnusable(
                f"run_dir {self.path.parent} cannot be used: {e.strerror or e} "
                f"({e.filename}). Give run_dir a folder this process can create and write"
            ) from None
        try:
            flock_works = True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self.refusal(self.read_holder(), checked=True) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                flock_works = False
            if flock_works and not self._still_at_path(fd):
                # A refused run removed the file (and its empty folder) between our open and our
                # flock: ours is an orphan that locks nothing; take the lock again
                raise _Orphaned
            holder = self.read_holder()
            if holder and not flock_works:
                same_host = holder.get("host") == socket.gethostname()
                if not same_host or pid_alive(int(holder["pid"]), holder.get("start")):
                    raise self.refusal(holder, checked=same_host)
            if holder:
                log.info(
                    f"{self.path}: {holder_text(holder)} is gone; its lock is stale: taken over"
                )
            me = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "start": process_start(os.getpid()),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except _Orphaned:
            os.close(fd)
            return self.acquire()
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        _held.add(self)

    def refusal(self, holder: dict, *, checked: bool) -> RunLocked:
        who = holder_text(holder) if holder else "another process"
        if checked:
            return RunLocked(
                f"{self.path.parent} is in use by a live run: {who}. Two runs in one folder would "
                "overwrite each other's checkpoints and metrics: wait for it, stop it, or give "
                "this run another run_dir"
            )
        return RunLocked(
            f"{self.path.parent} is locked by {who}, which cannot be checked from this host (this "
            f"filesystem has no flock). If that run is over, delete {self.path} and rerun"
        )

    def _still_at_path(self, fd: int) -> bool:
        try:
            here = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            folder = self.path.parent
            if self.made_folder and [p.name for p in folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()  # a refused run's own empty folder (the module docstring)
                folder.rmdir()
            else:
                os.ftruncate(self.fd, 0)  # emptied, never deleted (see the module docstring)
        except OSError:
            pass  # a disk gone full or read-only: the lock is the flock, which close releases
        finally:
            _held.discard(self)
            os.close(self.fd)  # closing releases the flock
            self.fd = None
