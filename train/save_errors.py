"""Why a checkpoint could not be written, in words a user can act on.

A full disk, a file-size limit (``ulimit -f``) or a folder that cannot be written reach the
trainer as whatever the writer made of them: torch's ``basic_ios::clear: iostream error`` or
``unexpected pos 6850752 vs 6850640`` (no errno, no path), or ``Parent directory ... does not
exist`` when DeepSpeed could not make the folder and went on. ``describe_write_failure`` finds
the cause from the error's errno when it has one, else by looking: a file of the folder that has
reached the process's file-size limit, a folder that does not take a small file, a file system
with no room left. The checkpointer then says what happened, where, and that the previous
checkpoint is intact (``latest`` moves only after a save completed).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import tempfile
from pathlib import Path

PROBE_BYTES = 1 << 20  # what a folder must take for "writable": more than a few bytes of metadata
LOW_SPACE = 64 << 20  # a file system with less free is called full


# The errors of a folder that cannot be written, kept as they are: the user's to fix
FOLDER_KINDS = (PermissionError, NotADirectoryError, FileNotFoundError, FileExistsError)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message says why, where, and what is intact."""


def _existing(folder: Path) -> Path:
    """``folder`` or the nearest of its parents that exists (a save may fail before making it)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _size_limit() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _at_limit(folder: Path, limit: int) -> Path | None:
    """A file under ``folder`` whose size has reached ``limit`` (a write stopped there)."""
    if not folder.is_dir():
        return None
    for path in folder.rglob("*"):
        try:
            if path.is_file() and path.stat().st_size >= limit:
                return path
        except OSError:
            continue
    return None


def _probe(folder: Path) -> OSError | None:
    """The error writing ``PROBE_BYTES`` into ``folder`` raises (None: it took them)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    return None


def describe_write_failure(folder: Path, error: BaseException) -> str:
    """What stopped writing into ``folder``: a disk that is full, a file-size limit, a folder that
    cannot be written, or (none of those found) the error as it came."""
    found = write_failure_cause(folder, error)
    return str(found) if found else f"{type(error).__name__}: {str(error).strip()[:300]}"


def write_failure_cause(folder: Path, error: BaseException) -> OSError | None:
    """What stopped writing into ``folder``, as an OSError whose message says it in words and
    whose class says whose it is: a plain OSError for a disk that is full or a file-size limit
    (the machine's), the error's own class (PermissionError, NotADirectoryError ...) for a
    folder that cannot be written. None: none of those found, the error is something else."""
    folder = Path(folder)
    code = getattr(error, "errno", None)
    limit = _size_limit()
    if code == errno.EFBIG or (limit is not None and _at_limit(folder, limit) is not None):
        hit = _at_limit(folder, limit) if limit is not None else None
        where = f" ({hit} stopped at {hit.stat().st_size} bytes)" if hit else ""
        shown = f"{limit} bytes" if limit is not None else "a limit"
        return OSError(
            f"a file reached the file-size limit of this process (ulimit -f: {shown}){where}"
        )
    base = _existing(folder)
    if code == errno.ENOSPC:
        return OSError(f"the disk is full (no space left on the file system of {base})")
    blocked = None
    if code in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
        blocked = error
    elif not folder.is_dir():
        if not base.is_dir():
            blocked = NotADirectoryError(errno.ENOTDIR, f"{base} is a file, not a folder")
        else:  # the folder was never made: its parent refused it
            blocked = _probe(base) or FileNotFoundError(errno.ENOENT, f"{folder} was not made")
    elif not isinstance(error, OSError) or code is None:
        blocked = _probe(folder)
    if blocked is not None and getattr(blocked, "errno", None) == errno.ENOSPC:
        return OSError(f"the disk is full (no space left on the file system of {base})")
    if blocked is not None:
        why = getattr(blocked, "strerror", None) or str(blocked)
        kind = next((k for k in FOLDER_KINDS if isinstance(blocked, k)), OSError)
        return kind(f"{folder} cannot be written ({why})")
    free = shutil.disk_usage(base).free
    if free < LOW_SPACE:
        return OSError(f"the disk is full ({free} bytes free on the file system of {base})")
    return None
