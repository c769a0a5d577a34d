"""The binary index of a token shard (``SHARD.idx.bin``): what the loader needs of every sample,
in fixed-size records it memory-maps, so that starting a loader costs the same at 10^4 samples
as at 10^9 (nothing per sample is read until a sample is).

The JSONL index (``SHARD.idx.jsonl``) stays the human-readable record and what ``verify``
checks; the binary index is derived from it, one to one, and names the SHA-256 of the JSONL it
was made from, so a stale one is never used (the loader compares it with the manifest's
``index_sha256`` and refuses the shard). ``earlyfuse-prep tokenize`` writes it beside every shard.

Layout: four ``.npy`` arrays back to back (``np.load`` on an open file reads them in turn, no
pickle anywhere)::

    header   uint8 [k]   UTF-8 JSON: format, version, index_sha256 (of the JSONL), samples,
                         tokens, shard_bytes (end of the last member), blocks (per modality:
                         count and longest, as the manifest's)
    records  [samples]   RECORD (below): member offsets and sizes, tokens, where the sample's
                         blocks and key lie, its SHA-256
    blocks   int64 [b, 5]   [start, end, t, h, w] of every visual block, samples in order
    keys     uint8 [c]   every key's UTF-8 bytes, back to back

Design choices:
- Fixed records, looked up by position: a sample costs one slice of a memory map, no parsing.
- A sample's hash is kept only where the index line's members are exactly ``json``,
  ``ids.npy``, ``mod.npy`` (the loader checks the hash over those three); otherwise zeros,
  as the loader always did for indexes without a usable hash.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "earlyfuse-token-index"
VERSION = 1
SUFFIX = ".idx.bin"  # SHARD.tar -> SHARD.idx.bin, beside SHARD.idx.jsonl
_MEMBERS = ("json", "ids.npy", "mod.npy")

RECORD = np.dtype(
    [
        ("json", "<i8", (2,)),  # [data offset, size] in the tar
        ("ids", "<i8", (2,)),
        ("mod", "<i8", (2,)),
        ("tokens", "<i8"),
        ("block_start", "<i8"),  # first row of ``blocks``
        ("block_count", "<i4"),
        ("key_start", "<i8"),  # first byte in ``keys``
        ("key_len", "<i4"),
        ("sha256", "u1", (32,)),
    ]
)


def block_stats(blocks: np.ndarray) -> dict[str, dict[str, int]]:
    """{"image"/"video": {"blocks", "longest"}} of ``[b, 5]`` blocks (t = 0: an image)."""
    out = {}
    for name, sel in (("image", blocks[:, 2] == 0), ("video", blocks[:, 2] != 0)):
        lengths = blocks[sel, 1] - blocks[sel, 0]
        out[name] = {"blocks": int(sel.sum()), "longest": int(lengths.max()) if len(lengths) else 0}
    return out


def build(jsonl: bytes, *, where: str = "index") -> bytes:
    """The binary index of a token shard's JSONL index (its bytes); ValueError naming the line
    when one is not a token index line or the offsets go back (not one shard's index)."""
    lines = jsonl.splitlines()
    records = np.zeros(len(lines), RECORD)
    blocks: list[list[int]] = []
    keys = bytearray()
    last, shard_bytes = -1, 0
    for line_no, line in enumerate(lines):
        try:
            entry = json.loads(line)
            members = entry["members"]
            rec = records[line_no]
            for name, field in (("json", "json"), ("ids.npy", "ids"), ("mod.npy", "mod")):
                rec[field] = members.get(name, [0, 0]) if name == "json" else members[name]
            rec["tokens"] = int(entry["tokens"])
            got = entry.get("blocks", [])
            rec["block_start"], rec["block_count"] = len(blocks), len(got)
            blocks += [[int(value) for value in block] for block in got]
            key = entry["key"].encode()
            rec["key_start"], rec["key_len"] = len(keys), len(key)
            keys += key
            if set(members) == set(_MEMBERS) and "sha256" in entry:
                rec["sha256"] = np.frombuffer(bytes.fromhex(entry["sha256"]), np.uint8)
            first = min(int(offset) for offset, _ in members.values())
            if first <= last:
                raise ValueError(
                    f"offsets go back at sample {entry['key']}: this is not one shard's index (a "
                    "pipe: command must print one shard: no glob in it)"
                )
            last = max(int(offset) + int(size) for offset, size in members.values())
            shard_bytes = max(shard_bytes, last)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(
                f"{where}:{line_no + 1}: not a token shard index line ({err})"
            ) from None
    block_arr = np.asarray(blocks, np.int64).reshape(-1, 5)
    header = {
        "format": FORMAT,
        "version": VERSION,
        "index_sha256": hashlib.sha256(jsonl).hexdigest(),
        "samples": len(lines),
        "tokens": int(records["tokens"].sum()),
        "shard_bytes": shard_bytes,
        "blocks": block_stats(block_arr),
    }
    out = io.BytesIO()
    for arr in (
        np.frombuffer(json.dumps(header, sort_keys=True).encode(), np.uint8),
        records,
        block_arr,
        np.frombuffer(bytes(keys), np.uint8),
    ):
        np.save(out, arr, allow_pickle=False)
    return out.getvalue()


def index_path_for(tar_path: str | Path) -> Path:
    tar = Path(tar_path)
    stem = tar.name[: -len(".tar")] if tar.name.endswith(".tar") else tar.name
    return tar.with_name(stem + SUFFIX)


@dataclass
class TokenIndex:
    """One shard's binary index, memory-mapped (or over bytes fetched from a remote store)."""

    header: dict
    records: np.ndarray
    blocks: np.ndarray
    keys: np.ndarray

    def __len__(self) -> int:
        return len(self.records)

    def key(self, i: int) -> str:
        record = self.records[i]
        start = int(record["key_start"])
        return self.keys[start : start + int(record["key_len"])].tobytes().decode()

    def blocks_of(self, i: int) -> np.ndarray:
        record = self.records[i]
        start = int(record["block_start"])
        return self.blocks[start : start + int(record["block_count"])]

    @classmethod
    def open(cls, path: str | Path) -> TokenIndex:
        """Memory-map a binary index file (ValueError when it is not one)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        return cls.from_buffer(buf, where=str(path))

    @classmethod
    def from_buffer(cls, buf, *, where: str = "index") -> TokenIndex:
        arrays = []
        view = memoryview(buf)
        pos = 0
        try:
            for _ in range(4):
                header_stream = io.BytesIO(view[pos : pos + 4096])
                version = np.lib.format.read_magic(header_stream)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(header_stream)
                else:
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(header_stream)
                if fortran or dtype.hasobject:
                    raise ValueError("not a plain C-order array")
                start = pos + header_stream.tell()
                count = int(np.prod(shape)) if shape else 1
                arr = np.frombuffer(buf, dtype, count=count, offset=start).reshape(shape)
                arrays.append(arr)
                pos = start + count * dtype.itemsize
            header = json.loads(arrays[0].tobytes())
        except (ValueError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: not a binary token index ({e})") from None
        if header.get("format") != FORMAT or arrays[1].dtype != RECORD:
            raise ValueError(f"{where}: not a binary token index (format {header.get('format')!r})")
        if header.get("version") != VERSION:
            raise ValueError(
                f"{where}: binary index version {header.get('version')}, expected {VERSION}"
            )
        return cls(header, arrays[1], arrays[2].reshape(-1, 5), arrays[3])
