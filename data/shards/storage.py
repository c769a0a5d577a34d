"""Files and folders of shards on this machine (paths, ``file://`` URLs) or in object storage
(fsspec URLs: ``s3://``, ``gs://``, ``az://``, ``memory://`` ...), for prep (``Folder``) and for
the loader (data/loader/store.py adds ``pipe:`` commands and reads by offset).

Design choices:
- Writers never stream into object storage: a shard is written to a local staging folder
  exactly as it would be locally (same bytes, same hashes), then uploaded whole, index first,
  and the shard's record last. An object PUT is atomic, so the record is the completion marker
  there as the renamed file is here; a job killed mid-upload leaves no record and is redone.
- Every remote call is retried (``RETRIES``, with backoff) and then fails as ``OSError``
  naming the URL, whatever the backend raised: a flaky server slows a job down, it does not
  kill it (the S3 client retries too; this covers what it gives up on).
- Readers of a remote raw shard download it (tar and index) to local staging first: tokenize
  reads every member of it anyway, and a local file makes every later read cheap.
- The backend of a scheme (``s3fs`` for ``s3://``: the optional extra ``s3``) is imported by
  fsspec on first use; its endpoint and credentials come from the usual settings
  (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``~/.aws/config``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

RETRIES = 5
ResultT = TypeVar("ResultT")


def is_remote(url: str | Path) -> bool:
    """An fsspec URL (``s3://``, ``memory://`` ...); a path or ``file://`` URL is local."""
    text = str(url)
    return "://" in text and not text.startswith("file://")


def local_path(url: str) -> str:
    """A local URL as a path (``file://`` stripped)."""
    return url[len("file://") :] if url.startswith("file://") else url


def filesystem(url: str):
    """(fsspec filesystem, path in it) of a remote URL."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # the scheme's backend (s3fs, gcsfs, aiohttp) is not installed
        raise ValueError(f"{url}: {e} (e.g. pip install 'earlyfuse[s3]')") from None


def retried(
    what: str, call: Callable[[], ResultT], retries: int = RETRIES, retry_missing: bool = False
) -> ResultT:
    """``call()``; on an error, again after 0.2, 0.4, ... s. A missing file (FileNotFoundError)
    is raised at once unless ``retry_missing``."""
    for attempt in range(retries):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - backends raise their own types (botocore, aiohttp)
            if isinstance(e, FileNotFoundError) and not retry_missing:
                # named: a backend's own text ("The specified bucket does not exist") says
                # neither which URL nor which command
                raise FileNotFoundError(f"{what}: {e}") from e
            if attempt == retries - 1:
                raise OSError(f"{what} failed {retries} times, the last: {e!r}") from e
            time.sleep(0.2 * 2**attempt)
    raise AssertionError("unreachable")


def read_bytes(url: str) -> bytes:
    """A file whole (remote: retried); FileNotFoundError naming it when it is not there."""
    if not is_remote(url):
        return Path(local_path(url)).read_bytes()
    fs, path = filesystem(url)
    try:
        return retried(url, lambda: fs.cat_file(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} does not exist") from None


def exists(url: str) -> bool:
    if not is_remote(url):
        return Path(local_path(url)).is_file()
    fs, path = filesystem(url)
    return retried(url, lambda: fs.isfile(path))


class Folder:
    """A folder addressed by a local path (or ``file://`` URL) or an fsspec URL; files named
    relative to it."""

    def __init__(self, url: str | Path) -> None:
        self.url = str(url).rstrip("/") if is_remote(url) else str(url)
        self.remote = is_remote(url)
        if self.remote:
            self.fs, self.root = filesystem(self.url)
        else:
            self.local = Path(local_path(self.url))

    def __str__(self) -> str:
        return self.url

    def absolute(self) -> str:
        """The URL, or the absolute path: what a job sent to another process or node names."""
        return self.url if self.remote else str(self.local.resolve())

    def child(self, rel: str) -> str:
        return f"{self.url}/{rel}" if self.remote else str(self.local / rel)

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    # --- reading ---------------------------------------------------------------------------
    def read_bytes(self, rel: str) -> bytes:
        return read_bytes(self.child(rel))

    def read_json(self, rel: str):
        return json.loads(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        return exists(self.child(rel))

    def sizes(self, under: str = "") -> dict[str, int]:
        """Relative name -> size of every file below ``under``, in one listing."""
        if not self.remote:
            base = self.local / under if under else self.local
            if not base.is_dir():
                return {}
            # Links to folders are followed (a folder of links to the sources to evaluate), each
            # real folder once: a link back up cannot loop.
            listing, seen = {}, set()
            for folder, subfolders, names in os.walk(base, followlinks=True):
                seen.add(os.path.realpath(folder))
                subfolders[:] = [
                    sub for sub in subfolders if os.path.realpath(Path(folder, sub)) not in seen
                ]
                for name in names:
                    file_path = Path(folder, name)
                    if file_path.is_file():
                        listing[str(file_path.relative_to(self.local))] = file_path.stat().st_size
            return listing
        path = self._path(under) if under else self.root
        try:
            found = retried(self.url, lambda: self.fs.find(path, detail=True))
        except FileNotFoundError:
            return {}
        self.fs.invalidate_cache()
        return {name[len(self.root) + 1 :]: int(info["size"]) for name, info in found.items()}

    def records(self, state_dir: str) -> dict[int, dict]:
        """The per-shard records in ``state_dir`` (index -> record), found in one listing and,
        remote, read in one request; a record cut short by a kill is skipped, so its shard is
        redone."""
        names = sorted(
            name
            for name in self.sizes(state_dir)
            if Path(name).name.startswith("shard-") and name.endswith(".json")
        )
        if self.remote:
            paths = [self._path(name) for name in names]
            blobs = list(retried(self.url, lambda: self.fs.cat(paths)).values()) if names else []
        else:
            blobs = [(self.local / name).read_bytes() for name in names]
        out = {}
        for blob in blobs:
            try:
                rec = json.loads(blob)
                out[int(rec["index"])] = rec
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def download(self, rel: str, dest: Path) -> Path:
        """The file ``rel`` as a local file: itself here, a copy at ``dest`` from there;
        FileNotFoundError naming it when it is not there."""
        if not self.remote:
            path = self.local / rel
            if not path.is_file():
                raise FileNotFoundError(f"{path} does not exist")
            return path
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            retried(self.child(rel), lambda: self.fs.get_file(self._path(rel), str(dest)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.child(rel)} does not exist") from None
        return dest

    # --- writing ---------------------------------------------------------------------------
    def write_json(self, rel: str, obj=None, *, lines: list | None = None) -> None:
        """``obj`` as indented JSON, or ``lines`` as JSON Lines, written atomically: here to a
        temporary name, synced and renamed; there in one PUT. A reader never sees half a file."""
        if lines is not None:
            text = "".join(
                json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n" for line in lines
            )
        else:
            text = json.dumps(obj, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
        data = text.encode("utf-8")
        if self.remote:
            retried(self.child(rel), lambda: self.fs.pipe_file(self._path(rel), data))
            return
        path = self.local / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def upload(self, local: Path, rel: str) -> None:
        retried(self.child(rel), lambda: self.fs.put_file(str(local), self._path(rel)))


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Name ``path`` in an OSError raised inside that names no file: a write, flush, fsync or
    close that fails on a full disk says only "[Errno 28] No space left on device", and the
    command's one line (data/cli/common.py ``os_error_line``) must say which file it was. The
    errno stays, and with it the kind (``PermissionError`` for EACCES) and the exit code."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` whole or not at all: a temporary file beside it, synced, renamed over
    it (a reader, or the next run after a kill, never finds half a file), and the rename synced
    (after a power loss the old file or the new one, never an empty one)."""
    write_all_atomic({path: data})


def write_all_atomic(files: Mapping[Path, bytes]) -> None:
    """Each file's bytes at its path, all of them or none of them against a failed write: every
    one is written to a temporary file beside its path and synced before the first is renamed
    over its path, so a write that fails (a full disk) leaves every old file as it was, never half
    a file nor a set mixing new files and old ones (the renames themselves do not fail for want
    of space). The temporary files of a failed write are removed, and the error names
    the file being written (a failed ``write`` names none, ``open`` its temporary). The renames
    are synced too (their folders). A temporary is this process's own: processes that write one
    file at once (the ranks of a node filling a cache) each rename a whole file over it."""
    temps = {path: path.with_name(f"{path.name}.{os.getpid()}.tmp") for path in files}
    try:
        for path, tmp in temps.items():
            with writing(path), open(tmp, "wb") as f:  # named by the file it stands for
                f.write(files[path])
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for tmp in temps.values():
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise
    for path, tmp in temps.items():
        os.replace(tmp, path)
    for folder in {path.parent for path in files}:
        sync_path(folder)


def write_folder(out: Path, write: Callable[[Path], ResultT]) -> ResultT:
    """Build the folder ``out`` whole beside it, in ``OUT.partial`` (``write(folder)`` puts the
    files there; its result is returned), then move it into place, replacing what
    ``check_new_folder`` let through. A write that fails or is interrupted (a full disk, Ctrl-C)
    removes ``OUT.partial`` and leaves ``out`` as it was (the old one is set aside, not
    deleted, until the new one is in its place): never a half-written folder that looks
    like a finished one, nor an old one deleted before the new one is complete. The files get
    the permissions the user's umask gives (safetensors writes 0600; the folder is to share)."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    aside = None  # a hidden folder beside OUT that holds the old OUT while the new one moves in
    try:
        result = write(tmp)
        mask = os.umask(0)
        os.umask(mask)
        for path in tmp.rglob("*"):
            if path.is_file():
                os.chmod(path, 0o666 & ~mask)
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, aside / out.name)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside and not out.exists():
            try:
                os.replace(aside / out.name, out)
            except OSError:  # kept where it is, and said so: never deleted with no new one
                kept, aside = aside / out.name, None
                what = "interrupted" if isinstance(e, KeyboardInterrupt) else str(e) or repr(e)
                why = f"{out}: not replaced ({what}); the previous one is in {kept}"
                if isinstance(e, Exception):
                    raise OSError(why) from e
                print(why, file=sys.stderr)  # Ctrl-C stays an interrupt
                raise e from None
        raise
    finally:
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
    return result


def sync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the names created or renamed in it
    durable). A file system that cannot sync a folder (some network ones) is left to its own
    guarantees."""
    folder = Path(path).is_dir()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if folder:  # a folder this process may write but not read (a drop folder)
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not folder:
            raise
    finally:
        os.close(fd)


class Staging:
    """Where a job writes the files it publishes: the folder itself when it is local, else a
    private temp folder whose files ``publish`` uploads (in the order given) and removes."""

    def __init__(self, dest: Folder) -> None:
        self.dest = dest
        self._temp = PrivateTemp("stage") if dest.remote else None
        self.tmp = self._temp.path if self._temp else None

    def path(self, rel: str) -> Path:
        return (self.tmp or self.dest.local) / rel

    def publish(self, rels: list[str]) -> None:
        if self.tmp is None:
            return
        for rel in rels:
            self.dest.upload(self.tmp / rel, rel)

    def close(self) -> None:
        if self._temp is not None:
            self._temp.close()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrivateTemp:
    """A temp folder of this process, ``earlyfuse-KIND-PID-XXXXXXXX``, removed on exit (a
    context manager, or ``close``). A job killed by SIGKILL cannot remove its own, and a staged
    or downloaded shard may be gigabytes, so each new one first removes those whose process is
    gone: exactly the names made here, of a PID that no longer exists on this machine."""

    KINDS = ("stage", "inputs", "verify")
    NAME = re.compile(rf"earlyfuse-(?:{'|'.join(KINDS)})-(\d+)-[a-z0-9_]{{8}}")  # mkdtemp's 8

    def __init__(self, kind: str) -> None:
        assert kind in self.KINDS, kind
        root = Path(tempfile.gettempdir())
        for old in root.glob("earlyfuse-*-*-*"):
            ours = self.NAME.fullmatch(old.name)
            if ours and old.is_dir() and not process_exists(int(ours[1])):
                shutil.rmtree(old, ignore_errors=True)
        self.path = Path(tempfile.mkdtemp(prefix=f"earlyfuse-{kind}-{os.getpid()}-", dir=root))

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        self.close()


def process_exists(pid: int) -> bool:
    """Whether a process of this PID exists on this machine (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
