"""Write one shard: a plain POSIX tar (stdlib ``tarfile``) and its index, side by side.

Design choices:
- Members carry fixed metadata (mtime 0, uid/gid 0, no owner names, mode 0644) so the same
  samples always give the same bytes, whatever machine or time wrote them.
- The index is written while the tar is written: one JSON line per sample with the byte
  offset and size of each member, so readers can seek to any sample without scanning.
- Both files are written under ``*.tmp`` names and renamed only when complete: a killed
  writer never leaves a shard that looks finished.
- The tar's SHA-256 is computed on the bytes as they stream out; no second read.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from data.schema import Sample, canonical_json
from data.shards.storage import writing

BLOCK = tarfile.BLOCKSIZE


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes and counts everything written through it."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.nbytes

    def write(self, b) -> int:
        self._f.write(b)
        self.sha.update(b)
        self.nbytes += len(b)
        return len(b)


@dataclass
class ShardResult:
    tar: str
    index: str
    samples: int
    bytes: int
    sha256: str
    index_sha256: str


def sample_hash(members: list[tuple[str, bytes]]) -> str:
    """SHA-256 over (name, size, bytes) of each member, in name order."""
    digest = hashlib.sha256()
    for name, data in sorted(members):
        digest.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        digest.update(data)
    return digest.hexdigest()


_USTAR_MAX_SIZE = 8**11 - 1  # larger members need a PAX size record


def member_header(name: str, size: int) -> bytes:
    """The 512-byte header ``tarfile`` writes for this member in PAX format. Our keys are ASCII:
    a name under 100 bytes needs no PAX record, so the header is the plain ustar one and is
    built directly (tarfile's PAX checks cost ~15 % of a text ingest); the same bytes either
    way (tests/test_data/test_engine_local.py checks)."""
    info = tarinfo(name, size)
    if len(name) < 100 and name.isascii() and size <= _USTAR_MAX_SIZE:
        return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class ShardWriter:
    """Append samples to ``<path>.tar`` and ``<path>.idx.jsonl``; ``close()`` publishes both."""

    def __init__(self, tar_path: str | Path, index_path: str | Path):
        self.tar_path, self.index_path = Path(tar_path), Path(index_path)
        self.tar_path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = open(self._tmp(self.tar_path), "wb")
        self._hf = _HashingFile(self._raw)
        self._tar = tarfile.open(fileobj=self._hf, mode="w", format=tarfile.PAX_FORMAT)
        self._idx = open(self._tmp(self.index_path), "wb")
        self._idx_sha = hashlib.sha256()
        self.samples = 0

    @staticmethod
    def _tmp(p: Path) -> Path:
        return p.with_name(p.name + ".tmp")

    def write(self, sample: Sample, extra_index: dict | None = None) -> dict:
        """Write one sample's members (JSON first) and its index line; returns the line."""
        members = sample.members()
        start = self._tar.offset
        offsets = {}
        for suffix, data in members:
            # What tarfile.addfile writes (header, data, zero padding to a block), written
            # straight through: the tar object only keeps the offset for its closing blocks.
            header = member_header(f"{sample.key}.{suffix}", len(data))
            padding = -len(data) % BLOCK
            with writing(self._tmp(self.tar_path)):
                self._hf.write(header)
                self._hf.write(data)
                if padding:
                    self._hf.write(bytes(padding))
            offsets[suffix] = [self._tar.offset + len(header), len(data)]
            self._tar.offset += len(header) + len(data) + padding
        entry = {
            "key": sample.key,
            "offset": start,
            "size": self._tar.offset - start,
            "members": offsets,
            "types": sample.segment_types(),
            "sha256": sample_hash(members),
        }
        if extra_index:
            entry.update(extra_index)
        line = canonical_json(entry) + b"\n"
        with writing(self._tmp(self.index_path)):
            self._idx.write(line)
        self._idx_sha.update(line)
        self.samples += 1
        return entry

    def close(self) -> ShardResult:
        with writing(self._tmp(self.tar_path)):
            self._tar.close()
            self._raw.flush()
            os.fsync(self._raw.fileno())
            self._raw.close()
        with writing(self._tmp(self.index_path)):
            self._idx.flush()
            os.fsync(self._idx.fileno())
            self._idx.close()
        # Index first: a tar never appears without its index.
        os.replace(self._tmp(self.index_path), self.index_path)
        os.replace(self._tmp(self.tar_path), self.tar_path)
        return ShardResult(
            str(self.tar_path),
            str(self.index_path),
            self.samples,
            self._hf.nbytes,
            self._hf.sha.hexdigest(),
            self._idx_sha.hexdigest(),
        )

    def abort(self) -> None:
        for handle in (self._raw, self._idx):
            try:
                handle.close()
            except OSError:
                pass
        for path in (self.tar_path, self.index_path):
            self._tmp(path).unlink(missing_ok=True)
