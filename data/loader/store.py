"""Where shards live: local paths, fsspec URLs (``s3://``, ``gs://``, ``https://``, ``file://``,
``memory://`` ...) and ``pipe:`` commands, behind one interface the loader reads through.

Design choices:
- The loader reads members by offset through the shard index (exact resume without replay), so
  every shard must be seekable. Local files and fsspec files are (fsspec turns a seek-and-read
  into a ranged GET: only this consumer's samples cross the network). A ``pipe:`` command is a
  stream, so its output is written once to a node-local cache folder (``cache_dir``) and read
  from there, like MosaicML Streaming's local shard cache; all workers and ranks of a node share
  it (a lock file per shard: one fetch each), and the least recently used shards are evicted
  beyond ``cache_limit_gb``.
- A ``pipe:`` command names its shard: the last word ending in ``.tar``. The index and the
  token manifest are fetched by the same command with that word replaced by
  ``<shard>.idx.jsonl`` and ``<folder>/manifest.json``, so one command pattern serves all three
  (``pipe:aws s3 cp s3://bucket/tokens/code/shard-{000000..000041}.tar -``).
- A command that fails is an error naming the command, its exit status and its stderr.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import posixpath
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_TAR_WORD = re.compile(r"(\S+\.tar)(?=[\s'\"]|$)")


def kind(url: str) -> str:
    if url.startswith("pipe:"):
        return "pipe"
    if "://" in url.split(" ", 1)[0] and not url.startswith("file:///"):
        return "fsspec"
    return "local"


def _local(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _fs(url: str):
    import fsspec
    return fsspec.core.url_to_fs(url)


def expand(pattern: str) -> list[str]:
    """Brace ranges ({000..041}, zero padding kept), then globs; a folder means its *.tar (deep).
    ``pipe:`` commands take brace ranges only (a ``*`` there is the command's business)."""
    m = _BRACE.search(pattern)
    if m:
        a, b = m.group(1), m.group(2)
        out = []
        for i in range(int(a), int(b) + 1):
            out += expand(pattern[:m.start()] + str(i).zfill(len(a)) + pattern[m.end():])
        return out
    k = kind(pattern)
    if k == "pipe":
        return [pattern]
    if k == "fsspec":
        fs, path = _fs(pattern)
        if any(c in path for c in "*?["):
            return sorted(fs.unstrip_protocol(p) for p in fs.glob(path))
        if fs.isdir(path):
            return sorted(fs.unstrip_protocol(p) for p in fs.find(path) if p.endswith(".tar"))
        return [pattern]
    path = _local(pattern)
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
    if kind(url) == "pipe":
        m = _tar_word(url)
        folder = posixpath.dirname(m.group(1))
        for _ in range(up):
            folder = posixpath.dirname(folder)
        return url[:m.start()] + posixpath.join(folder, name) + url[m.end():]
    folder = posixpath.dirname(url)
    for _ in range(up):
        folder = posixpath.dirname(folder)
    return posixpath.join(folder, name)


def name(url: str) -> str:
    """The shard's file name (of a ``pipe:`` command: its .tar word's)."""
    return posixpath.basename(_tar_word(url).group(1) if kind(url) == "pipe" else url)


def index_url(url: str) -> str:
    base = name(url)
    stem = base[:-len(".tar")] if base.endswith(".tar") else base
    return sibling(url, stem + ".idx.jsonl")


def _run(cmd: str) -> bytes:
    p = subprocess.run(cmd, shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if p.returncode != 0:
        raise FileNotFoundError(f"pipe: {cmd!r} exited with {p.returncode}: "
                                f"{p.stderr.decode(errors='replace').strip()[-400:]}")
    return p.stdout


def read_bytes(url: str) -> bytes:
    """A small file whole (an index, a manifest). FileNotFoundError when it is not there."""
    k = kind(url)
    if k == "pipe":
        return _run(url[len("pipe:"):])
    if k == "fsspec":
        fs, path = _fs(url)
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"{url} does not exist") from None
    return Path(_local(url)).read_bytes()


def exists(url: str) -> bool:
    k = kind(url)
    if k == "pipe":
        return True             # known only by running it; a failing command is reported when read
    if k == "fsspec":
        fs, path = _fs(url)
        return fs.isfile(path)
    return Path(_local(url)).is_file()


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"earlyfuse-shards-{os.getuid()}")


class ShardFiles:
    """Open shards, at most ``keep`` at a time (least recently used closed first)."""

    def __init__(self, cache_dir: str | None = None, cache_limit_gb: float = 64.0, keep: int = 8) -> None:
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.cache_limit = int(cache_limit_gb * 2**30)
        self.keep = keep
        self._open: dict[str, BinaryIO] = {}

    def get(self, url: str) -> BinaryIO:
        f = self._open.pop(url, None)
        if f is None:
            if len(self._open) >= self.keep:
                self._open.pop(next(iter(self._open))).close()
            f = self._opener(url)
        self._open[url] = f            # re-inserted last: the dict's order is the LRU order
        return f

    def read(self, url: str, offset: int, size: int) -> bytes:
        f = self.get(url)
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise ValueError(f"member cut short ({len(data)} of {size} bytes)")
        return data

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _opener(self, url: str) -> BinaryIO:
        k = kind(url)
        if k == "pipe":
            return open(self.fetch(url), "rb")
        if k == "fsspec":
            import fsspec
            # Readahead blocks: a consumer's samples of one shard lie within a shuffle window.
            return fsspec.open(url, "rb", block_size=4 << 20, cache_type="readahead").open()
        return open(_local(url), "rb")

    def fetch(self, url: str) -> Path:
        """The ``pipe:`` command's output in the node-local cache (fetched once per node)."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(url.encode()).hexdigest()[:24]
        path = self.cache_dir / f"{name}.tar"
        with open(self.cache_dir / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)       # another worker fetching it: wait for it
            if path.is_file():
                os.utime(path)                     # recently used
                return path
            self._evict()
            part = path.with_suffix(".part")
            with open(part, "wb") as out:
                p = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=out, stderr=subprocess.PIPE)
                _, err = p.communicate()
            if p.returncode != 0:
                part.unlink(missing_ok=True)
                raise FileNotFoundError(f"{url!r} exited with {p.returncode}: "
                                        f"{err.decode(errors='replace').strip()[-400:]}")
            os.replace(part, path)
        return path

    def _evict(self) -> None:
        files = sorted(self.cache_dir.glob("*.tar"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        now = time.time()
        for p in files:
            if total <= self.cache_limit:
                break
            if now - p.stat().st_mtime < 60:
                break      # in use right now by someone: never evict a shard fetched this minute
            total -= p.stat().st_size
            p.unlink(missing_ok=True)   # an open reader keeps its inode; the next open refetches
