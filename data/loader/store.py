"""Where shards live: local paths (``file://`` URLs too), fsspec URLs (``s3://``, ``gs://``,
``https://``, ``memory://`` ...; opened and read whole through data/shards/storage.py, which
prep uses too) and ``pipe:`` commands, behind one interface the loader reads through.

The loader reads members by offset through the shard index (exact resume without replay), so
every shard must be seekable. Local and fsspec files are (fsspec turns a seek-and-read into a
ranged GET: only this consumer's samples cross the network). A ``pipe:`` command's output is a
stream, so it is written once to a node-local cache shared by all workers and ranks of the node
(like MosaicML Streaming's shard cache). How a command names its shard and index, what a failing
command or read does and how the cache is evicted: docs/loader.md, "Where shards live".
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import math
import mmap
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from data.names import INDEX_SUFFIX
from data.shards import storage

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
# The shard's word in a pipe: command: ends in .tar, followed by a space, quote, pipe, ;, &, ), >
# or the end. Paths inside commands must not hold spaces.
_TAR_WORD = re.compile(r"([^\s'\"]+\.tar)(?=[\s'\";|&)>]|$)")
RETRIES = 3
FAILED_FOR = 60.0
# How long a remote read waits for its storage to come back before its sample is skipped: an
# object store that is down for a minute (a restart, a network blip) slows a run, it does not
# eat its data. Once a wait has run out, reads fail after their RETRIES for FAILED_FOR seconds.
PATIENCE = 120.0
# Bytes read through the memory maps between two hand-backs of their pages (ShardFiles.release)
RELEASE_BYTES = 32 << 20
KEEP_OPEN, KEEP_MAPS = 8, 256  # remote handles and memory maps a ShardFiles keeps open at most


def kind(url: str) -> str:
    if url.startswith("pipe:"):
        return "pipe"
    return "fsspec" if storage.is_remote(url) else "local"


def expand(pattern: str) -> list[str]:
    """Brace ranges ({000..041}, zero padding kept), then globs; a folder means its *.tar (deep).
    Local shards come out as paths (``file://`` stripped): the shard URLs the loader reads.
    ``pipe:`` commands take brace ranges only: one command, one shard (a glob inside a command
    would print several; table_load.py refuses the index that results)."""
    m = _BRACE.search(pattern)
    if m:
        a, b = m.group(1), m.group(2)
        out = []
        for i in range(int(a), int(b) + 1):
            out += expand(pattern[: m.start()] + str(i).zfill(len(a)) + pattern[m.end() :])
        return out
    k = kind(pattern)
    if k == "pipe":
        return [pattern]
    if k == "fsspec":
        if pattern.endswith(".tar") and not any(c in pattern for c in "*?["):
            return [pattern]  # a shard: no listing call (over http that would be a GET of it)
        fs, path = storage.filesystem(pattern)
        if any(c in path for c in "*?["):
            return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))
        if fs.isdir(path):
            return sorted(fs.unstrip_protocol(p) for p in fs.find(path) if p.endswith(".tar"))
        return [pattern]
    path = storage.local_path(pattern)
    p = Path(path)
    if p.is_dir():
        return sorted(str(x) for x in p.rglob("*.tar"))
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path, recursive=True))
    return [path]


def _tar_word(cmd: str) -> re.Match:
    found = list(_TAR_WORD.finditer(cmd))
    if not found:
        raise ValueError(f"{cmd!r}: a pipe: command must name its shard (a word ending in .tar)")
    return found[-1]


def sibling(url: str, name: str, up: int = 0) -> str:
    """The file ``name`` beside shard ``url`` (``up`` folders higher), in the same kind of URL."""
    word = _tar_word(url) if kind(url) == "pipe" else None
    folder = posixpath.dirname(word.group(1) if word else url)
    for _ in range(up):
        folder = posixpath.dirname(folder)
    path = posixpath.join(folder, name)
    return url[: word.start()] + path + url[word.end() :] if word else path


def name(url: str) -> str:
    """The shard's file name (of a ``pipe:`` command: its .tar word's)."""
    return posixpath.basename(_tar_word(url).group(1) if kind(url) == "pipe" else url)


def beside(url: str, suffix: str) -> str:
    """The shard's file of the same stem with ``suffix`` (its index: ``SHARD.idx.jsonl``)."""
    base = name(url)
    return sibling(url, (base[: -len(".tar")] if base.endswith(".tar") else base) + suffix)


def index_url(url: str) -> str:
    return beside(url, INDEX_SUFFIX)


def read_bytes(url: str) -> bytes:
    """A small file whole (an index, a manifest). FileNotFoundError when it is not there."""
    if kind(url) != "pipe":
        return storage.read_bytes(url)
    cmd = url[len("pipe:") :]
    p = subprocess.run(cmd, shell=True, capture_output=True, start_new_session=True)
    if p.returncode != 0:
        raise FileNotFoundError(
            f"pipe: {cmd!r} exited with {p.returncode}: "
            f"{p.stderr.decode(errors='replace').strip()[-400:]}"
        )
    return p.stdout


def exists(url: str) -> bool:
    # A command is known only by running it: a failing one is reported when read.
    return kind(url) == "pipe" or storage.exists(url)


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"earlyfuse-shards-{os.getuid()}")


class ShardFiles:
    """Memory maps of local and fetched ``pipe:`` shards, at most ``KEEP_MAPS``, and open remote
    shards, at most ``KEEP_OPEN`` handles at a time (least recently used closed first).

    Readers count what they read through the maps (``touched``) and every ``RELEASE_BYTES`` the
    maps' pages are handed back (``release``), so that the RSS does not hold every page of every
    shard read (docs/loader.md, "The maps hold what was read lately")."""

    def __init__(self, cache_dir: str | None = None, cache_limit_gb: float = 64.0) -> None:
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.cache_limit = int(cache_limit_gb * 2**30)
        self._open: dict[str, BinaryIO] = {}
        self._maps: dict[str, memoryview] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # pipe: fetches that failed lately
        self._gave_up = -math.inf  # when a remote read last waited PATIENCE in vain
        self._touched = 0  # bytes read through the maps since their pages were last released

    def view(self, url: str, offset: int, size: int, min_bytes: int = 0) -> memoryview | bytes:
        """``size`` bytes at ``offset``: a slice of the shard's memory map (local shards and
        fetched ``pipe:`` shards: mapped once per process, no read call per sample), or a read
        (fsspec). A map lives as long as an array made from it: evicting one only forgets it."""
        mapped = self.mapped(url, min_bytes)
        if mapped is None:
            return self.read(url, offset, size)
        if offset + size > len(mapped):
            raise ValueError(f"member cut short ({max(0, len(mapped) - offset)} of {size} bytes)")
        self.touched(size)
        return mapped[offset : offset + size]

    def touched(self, size: int) -> None:
        """``size`` more bytes read through the maps; past ``RELEASE_BYTES``, ``release``."""
        self._touched += size
        if self._touched >= RELEASE_BYTES:
            self.release()

    def release(self) -> None:
        """Every map's pages handed back to the kernel: this process's RSS then holds none of
        them, the arrays made from the maps stay valid (a read faults the page back in from
        the page cache: the shards are read-only files)."""
        self._touched = 0
        for mapped in self._maps.values():
            if isinstance(mapped.obj, mmap.mmap):
                mapped.obj.madvise(mmap.MADV_DONTNEED)

    def mapped(self, url: str, min_bytes: int = 0) -> memoryview | None:
        """The whole shard's memory map (local and fetched ``pipe:`` shards; None for fsspec
        URLs, which are read by ranges)."""
        mapped = self._maps.pop(url, None)
        if mapped is None:
            if kind(url) == "fsspec":
                return None
            if len(self._maps) >= KEEP_MAPS:
                self._maps.pop(next(iter(self._maps)))
            path = self._local_file(url, min_bytes)
            with open(path, "rb") as f:
                n = os.fstat(f.fileno()).st_size
                # Kept as a memoryview of the map: a slice per sample, nothing else made.
                mapped = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if n else b"")
        self._maps[url] = mapped  # re-inserted last: the dict's order is the LRU order
        return mapped

    def get(self, url: str) -> BinaryIO:
        """An open handle on a remote shard."""
        f = self._open.pop(url, None)
        if f is None:
            if len(self._open) >= KEEP_OPEN:
                self._open.pop(next(iter(self._open))).close()
            # Readahead blocks: a consumer's samples of one shard lie within a shuffle window.
            # (Through fs.open: fsspec.open would hand these options to the filesystem's
            # constructor, which s3fs refuses -- found by the moto-backed test.)
            fs, path = storage.filesystem(url)
            f = fs.open(path, "rb", block_size=4 << 20, cache_type="readahead")
        self._open[url] = f  # re-inserted last: the dict's order is the LRU order
        return f

    def read(self, url: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of a remote shard (a ranged read). Tried ``RETRIES`` times
        (a new handle each, a missing object too), then again every few seconds for up to
        ``PATIENCE`` while the storage does not answer (said once on stderr), and then failing
        as OSError whatever the backend raised, so an outage is never a dead worker: the sample
        is skipped and counted like unreadable data."""

        def once() -> bytes:
            try:
                f = self.get(url)
                f.seek(offset)
                return f.read(size)
            except Exception:
                self._drop(url)  # the next try opens a new handle
                raise

        start, said = time.monotonic(), False
        while True:
            try:
                data = storage.retried(f"{url}: read", once, RETRIES, retry_missing=True)
                break
            except OSError as e:
                now = time.monotonic()
                if isinstance(e.__cause__, FileNotFoundError) or now - self._gave_up < FAILED_FOR:
                    raise  # an answer (no such object), or a storage given up on a moment ago
                if now - start >= PATIENCE:
                    self._gave_up = now
                    raise
                if not said:
                    print(
                        f"[loader] {url}: the storage does not answer ({e.__cause__!r}); "
                        f"waiting up to {PATIENCE:.0f} s before its samples are skipped",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(min(5.0, PATIENCE - (now - start)))
        if len(data) != size:
            raise ValueError(f"member cut short ({len(data)} of {size} bytes)")
        return data

    def _drop(self, url: str) -> None:
        f = self._open.pop(url, None)
        if f is not None:
            with contextlib.suppress(Exception):  # a broken handle is being thrown away anyway
                f.close()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
        self._maps.clear()  # unmapped once no array made from them is left

    def _local_file(self, url: str, min_bytes: int) -> str:
        """A local path of a local or ``pipe:`` shard (fetched into the cache)."""
        if kind(url) == "pipe":
            # A shard whose fetch failed is not fetched again for every one of its samples: they
            # fail at once with the same error for FAILED_FOR seconds, then it is tried again.
            when, why = self._failed.get(url, (0.0, ""))
            if time.monotonic() - when < FAILED_FOR:
                raise FileNotFoundError(
                    f"{why} (failed {time.monotonic() - when:.0f} s ago; retried after "
                    f"{FAILED_FOR:.0f} s)"
                )
            try:
                return str(self.fetch(url, min_bytes))
            except OSError as e:
                self._failed[url] = (time.monotonic(), str(e))
                raise
        return url

    def fetch(self, url: str, min_bytes: int = 0) -> Path:
        """The ``pipe:`` command's output in the node-local cache (fetched once per node). Output
        shorter than the index says the shard is (``min_bytes``: its last member's end) is an
        error, never cached: ``curl`` without ``-f`` writes error pages and exits 0."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(url.encode()).hexdigest()[:24]
        path = self.cache_dir / f"{name}.tar"
        with open(self.cache_dir / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker fetching it: wait for it
            if path.is_file():
                os.utime(path)  # recently used
                return path
            self._evict()
            part = path.with_suffix(f".part{os.getpid()}")
            with open(part, "wb") as out:
                p = subprocess.Popen(  # a session of its own: a group signal is the trainer's
                    url[len("pipe:") :],
                    shell=True,
                    stdout=out,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                _, err = p.communicate()
            got = part.stat().st_size
            if p.returncode != 0 or got < min_bytes:
                part.unlink(missing_ok=True)
                why = (
                    f"exited with {p.returncode}"
                    if p.returncode
                    else f"wrote {got} bytes, its index needs at least {min_bytes}"
                )
                raise FileNotFoundError(
                    f"{url!r} {why}: {err.decode(errors='replace').strip()[-400:]}"
                )
            os.replace(part, path)
            # Which command a cached file came from, for whoever looks into the cache.
            path.with_suffix(".url").write_text(url + "\n")
        return path

    def _evict(self) -> None:
        """Oldest shards out until the cache is under its limit. One process at a time (a
        cache-wide lock); files another node process removed meanwhile are simply gone."""
        with open(self.cache_dir / ".evict.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = []
            for p in self.cache_dir.iterdir():
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                if ".part" in p.suffix and time.time() - st.st_mtime > 3600:
                    p.unlink(missing_ok=True)  # left by a fetch that died
                elif p.suffix == ".tar":
                    entries.append((st.st_mtime, st.st_size, p))
                elif p.suffix == ".url" and not p.with_suffix(".tar").exists():
                    p.unlink(missing_ok=True)
            total = sum(size for _, size, _ in entries)
            now = time.time()
            for mtime, size, p in sorted(entries):
                if total <= self.cache_limit or now - mtime < 60:
                    break  # under the limit, or in use right now: never evict this minute's shards
                p.unlink(missing_ok=True)  # an open reader keeps its inode; the next open refetches
                total -= size


class ShardView:
    """A shard as a file for readers that seek then read (a raw document's members): every read
    goes through ``ShardFiles.view``, so it reads what a token document's read does."""

    def __init__(self, files: ShardFiles, url: str, min_bytes: int = 0) -> None:
        self.files, self.url, self.min_bytes, self.pos = files, url, min_bytes, 0

    def seek(self, offset: int) -> None:
        self.pos = offset

    def read(self, size: int) -> bytes:
        data = bytes(self.files.view(self.url, self.pos, size, self.min_bytes))
        self.pos += len(data)
        return data
