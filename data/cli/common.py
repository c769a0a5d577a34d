"""What the subcommands share (and earlyfuse-eval's and earlyfuse-convert's): sizes like 256MB,
paths or URLs, output folders, devices, the engine flags, the exit codes."""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import resource
import sys
import tempfile
import warnings
from pathlib import Path

from data.shards.storage import is_remote, local_path

EXIT_REJECTS = 3
# Exit code 2: what the user gave cannot be used (a value, a missing or wrong file or folder, one
# that may not be read or written). Any other OSError (a full disk, an I/O error) is exit code 1.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)

# What stopped a write, by errno, and what to do about it before the command runs again.
_NO_WRITE = {
    errno.ENOSPC: ("the disk is full", "free space on it"),
    errno.EDQUOT: ("this user's disk quota is used up", "free space or raise the quota"),
    errno.EROFS: ("the file system is read-only", "make it writable"),
    # EACCES and EPERM come from reads too (an input this user may not open): said either way
    errno.EACCES: ("permission denied", "let this user write there (and read the inputs)"),
    errno.EPERM: ("operation not permitted", "let this user write there (and read the inputs)"),
}


def os_error_line(e: OSError, resumes: bool = False) -> str | None:
    """The one line for a command stopped by a file it could not write (a full disk, a quota,
    a file-size limit, a read-only or forbidden folder): the file, what stopped it, what to do,
    and (``resumes``: a command that keeps what it finished) that the same command then goes
    on where it stopped. None for any other error: its own text says it."""
    # a copy names its source first and the file it wrote second
    path = e.filename2 if e.filename2 is not None else e.filename
    if path is None or (e.errno not in _NO_WRITE and e.errno != errno.EFBIG):
        return None
    if e.errno == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft == resource.RLIM_INFINITY:
            what, fix = "the file is larger than its file system takes", "use another one"
        else:
            what = f"the file reached this process's file-size limit (ulimit -f: {soft} bytes)"
            fix = "raise the limit"
    else:
        what, fix = _NO_WRITE[e.errno]
    verb = "cannot be written" if e.errno not in (errno.EACCES, errno.EPERM) else "cannot be used"
    then = ": it resumes, keeping what it finished" if resumes else ""
    again = f"{fix.capitalize()}, then run the same command again{then}"
    return f"{os.fsdecode(path)}: {verb}: {what}. {again}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'256MB' -> 256000000, '4MiB' -> 4194304, '0' -> 0 (no limit)."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 256MB, 4MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[unit])


def positive_int(text: str) -> int:
    """An argparse type for a count that must be at least 1 (a row length, rows per batch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a count (give 1 or more)")
    return value


def path_or_url(text: str) -> Path | str:
    """A local folder (Path; a ``file://`` URL's path) or an fsspec URL kept as text (``Path``
    would fold ``s3://``)."""
    return text if is_remote(text) else Path(local_path(text))


def out_folder(text: str) -> Path | str:
    """An output folder (``path_or_url``) refused at once, before any input is read, when a file
    stands where it or a folder above it would be (mkdir would say "File exists" or "Not a
    directory" after the planning)."""
    out = path_or_url(text)
    if isinstance(out, Path):
        file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            raise argparse.ArgumentTypeError(f"{text}: {file} is a file, not a folder")
    return out


def local_folder(text: str) -> Path:
    """A folder of a command that reads and writes local files only, refused at once when it is
    an fsspec URL (``Path`` would fold ``s3://bucket/x`` into the local folder ``s3:/bucket/x``)."""
    if is_remote(text):
        raise argparse.ArgumentTypeError(
            f"{text}: an object storage URL; this command reads and writes local folders only "
            "(copy it here first)"
        )
    return Path(local_path(text))


def check_new_folder(out: Path, force: bool, source: Path, error: type = ValueError) -> None:
    """An ``error`` (a ValueError), before any work, for an output folder that would fail or do
    harm when it is written at the end: one holding the input folder ``source`` (which ``force``
    would delete) or inside it, a folder or a file in the way without ``force``, one under a
    file or under a folder that takes no new folder (tried: permission bits say yes to root for
    /proc or a read-only mount), or a symbolic link (the folder is written whole beside it and
    moved into its place, which a link to a folder is not)."""
    if out.is_symlink():
        raise error(f"{out}: a symbolic link (to {os.readlink(out)}); give a folder's own path")
    if source.resolve().is_relative_to(out.resolve()):
        raise error(f"{out}: is or holds the input {source}; choose another folder")
    if out.resolve().is_relative_to(source.resolve()):
        raise error(f"{out}: inside the input {source}; choose a folder outside it")
    if out.exists() and not out.is_dir() and not force:
        raise error(f"{out}: a file; choose another folder or pass --force to replace it")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise error(f"{out}: exists and is not empty; choose another folder or pass --force")
    parent = next(folder for folder in out.absolute().parents if folder.exists())
    if not parent.is_dir():
        raise error(f"{out}: cannot be written ({parent} is a file, not a folder)")
    try:
        probe = tempfile.mkdtemp(dir=parent, prefix=".write-probe-")
    except OSError as e:
        why = f"{parent} takes no new folder: {e.strerror or e}"
        raise error(f"{out}: cannot be written ({why})") from None
    os.rmdir(probe)


def out_file(text: str) -> Path:
    """An output file refused before any work when it is a folder, or a file stands where a
    folder above it would be (``out_folder``): written at the end, its work would be lost."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    out_folder(str(Path(text).parent))
    return Path(text)


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (None: it can), found before any work and without
    making anything, so that a run refused later leaves no folder behind: ``path`` is a folder,
    a file stands where a folder above it would be, or the nearest folder that exists does not
    take a new file. That is tried (a temporary file made and removed there), not read from the
    permission bits, which say yes to root for /proc or a read-only mount."""
    if path.is_dir():
        return "a folder: give a file name"
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if path.exists() and not os.access(path, os.W_OK):
        return "not writable"
    try:
        tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-").close()
    except OSError as e:
        return f"{folder} takes no new file: {e.strerror or e}"
    return None


def writable(path: str | Path, *, image: bool = False, error: type[Exception] = ValueError) -> Path:
    """``path``, refused (by ``error``) before any work when a file cannot be written there or
    (``image``) its name ends in what Pillow writes no RGB image as (no ending: a PNG); nothing
    is made (its folder: ``with_folder`` when it is written)."""
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash that says "a folder"
        raise error(f"{path}: a folder; give a file name")
    path = Path(path)
    if why := unwritable(path):
        raise error(f"{path}: cannot write there ({why})")
    if image and path.suffix and path.suffix.lower() not in (names := rgb_image_formats()):
        endings = " ".join(names)
        raise error(f"{path}: not an image name Pillow writes; give one of: {endings}")
    return path


def with_folder(path: Path | str) -> Path:
    """``path`` with its folder made, just before its file is written (``unwritable`` made none)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return Path(path)


@functools.cache
def rgb_image_formats() -> dict[str, str]:
    """The file extensions Pillow writes an RGB image under, and their formats (``.jpg``: JPEG).
    Tried on a small image: Pillow registers formats it only reads (``.psd``) and some it writes
    in other modes only (``.xbm``: 1 bit)."""
    import io

    from PIL import Image

    sample, formats = Image.new("RGB", (8, 8)), {}
    for ext, name in sorted(Image.registered_extensions().items()):
        try:
            with warnings.catch_warnings():  # a deprecated format (.im) still writes
                warnings.simplefilter("ignore")
                sample.save(io.BytesIO(), name)
        except Exception:  # noqa: BLE001 - whatever a plugin raises for what it cannot write
            continue
        formats[ext] = name
    return formats


def reader_left() -> int:
    """The exit of a command whose stdout reader left (`stats DIR | head`, `earlyfuse-generate
    --batch FILE | head`): quiet, as a process that SIGPIPE ended would; stdout goes to /dev/null
    so that the exit's flush does not fail too."""
    import signal

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def checked_device(name: str, *, here: bool = True) -> str:
    """A torch device name (cpu, cuda, cuda:1) checked before any work: a ValueError naming it
    when torch has no such kind of device, or (``here``) when this machine has no such device
    (jobs sent to a Ray cluster run on its nodes, which may have GPUs the driver lacks)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: not a device (cpu, cuda, cuda:1, ...)") from None
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if here and device.type == "cuda" and (device.index or 0) >= count:
        has = f"has {count} CUDA device(s)" if count else "has no CUDA device torch can use"
        raise ValueError(f"--device {name}: this machine {has}")
    return name


def _add_engine_flags(p) -> None:
    """--workers, the partition flags, --engine and --ray-address: how ingest and tokenize
    spread their shard jobs (see docs/scaling.md)."""
    p.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        help="parallel worker processes (default 1); on Ray, at most this many CPU actors "
        "(default: one per cluster CPU)",
    )
    p.add_argument(
        "--num-partitions",
        type=positive_int,
        default=1,
        metavar="P",
        help="split the shards across P independent runs (e.g. a Slurm array), then `merge`",
    )
    p.add_argument(
        "--partition",
        type=int,
        default=0,
        metavar="I",
        help="which of the P partitions this run writes (0-based)",
    )
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="where the shard jobs run: local worker processes (default) or a Ray cluster "
        "(pip install 'earlyfuse[ray]'; every node must see the inputs and --out)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (default: $RAY_ADDRESS, else a local Ray for this command)",
    )
    p.add_argument(
        "--ray-storage-env",
        choices=("node", "driver"),
        default="node",
        help="whose object-storage settings (AWS_*, FSSPEC_*, AZURE_STORAGE_*, "
        "GOOGLE_APPLICATION_CREDENTIALS) the Ray actors use: node (default): a node's own, "
        "this command's filling in what it lacks (credentials as a set: a node with its own "
        "takes none of these); driver: this command's alone (docs/scaling.md)",
    )


def _engine(a):
    """The engine the flags ask for; a Ray address where nothing answers is refused here, before
    any planning, and more local workers than CPUs is said (they share the CPUs)."""
    from data.engine import EngineConfig
    from data.engine.local import cpu_count

    if a.engine == "ray":
        from data.engine.ray import check_address

        check_address(a.ray_address)
    elif (a.workers or 1) > cpu_count():
        print(
            f"warning: --workers {a.workers} is more than the {cpu_count()} CPU(s) this process "
            "may use: the workers share them (no faster, more memory)",
            file=sys.stderr,
        )
    # Not given: 1 local worker; on ray 0, one actor per cluster CPU (a given 1 is one actor).
    workers = a.workers or (1 if a.engine == "local" else 0)
    return EngineConfig(
        kind=a.engine, workers=workers, address=a.ray_address, storage_env=a.ray_storage_env
    )


def command_line(a: argparse.Namespace) -> list[str]:
    """The command as run (``main``'s arguments), as ingest and tokenize record it in their
    records and manifest."""
    return ["earlyfuse-prep", *a.argv]
