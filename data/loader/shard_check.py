"""Token shards checked whole, once, when a consumer first reads from them, so that their
documents are then handed out without any per-document check (reading and checking each
document on its own would cost about as much as the rest of the loader's work on it).

Design choices:
- The shard-level digest is the SHA-256 of the whole tar that ``earlyfuse-prep tokenize`` (and
  the merge of its partitions) records in the manifest's shard line (``sha256``, the same value
  ``earlyfuse-prep verify`` checks). One ``hashlib`` call over the shard's memory map: C speed,
  and hashlib releases the GIL for large buffers, so a DataLoader worker's hashing does not
  hold up the trainer's thread.
- Then every document's ``.npy`` members are parsed once, their lengths compared with the index,
  and the ids of the whole shard checked against their modalities' vocabulary ranges in one
  vectorised pass (``check_ids`` over the concatenation).
- A shard that passes is kept as a few arrays (where each document's ids and modalities start
  in the memory map, their dtypes, its length and blocks): reading a document is two
  ``np.frombuffer`` views, no parsing, no check. About 64 bytes a document with the table the
  compiled loop's intake reads (a shard of 50,000 documents: 3.2 MB; at most 256 shards kept
  per consumer), so a consumer can keep every shard it is reading from.
- A shard that fails anything (tar changed since the manifest, a corrupted document, an id out
  of range), that has no shard digest (a manifest written without digests, or a shard it does
  not list), or that cannot be mapped (fsspec URLs: hashing would read the whole shard over
  the network) is read document by document: each document read and checked on its own, so a bad
  document costs that document only, and is skipped, counted and named as always.
- ``check_hashes=False``: no hash is computed; the id check of the whole shard still runs.
- Each consumer checks the shards it reads from, and consumers (ranks x workers) each read
  1/consumers of every shard: beyond ``whole_shard_check_max_consumers`` (default 8) a
  consumer would hash far more than it reads, so shards are then checked document by document.
"""

from __future__ import annotations

import hashlib

import numpy as np

from data.loader.packer import Unit, units_of
from data.loader.sample_check import check_ids
from data.shards import token_index


class CheckedShard:
    """A shard that passed the whole-shard check: its documents, read without further checks."""

    def __init__(
        self,
        mapped: memoryview,
        index: token_index.TokenIndex,
        ids_dtype: np.dtype,
        mod_dtype: np.dtype,
        ids_at: list[int],
        mod_at: list[int],
    ) -> None:
        self.mapped, self.index = mapped, index
        self.ids_dtype, self.mod_dtype = ids_dtype, mod_dtype
        # where each document's ids and modalities start in the map (int64: compact)
        self.ids_at = np.asarray(ids_at, np.int64)
        self.mod_at = np.asarray(mod_at, np.int64)
        self.lengths = index.records["tokens"]
        self.block_start = index.records["block_start"]
        self.block_count = index.records["block_count"]
        # The same per document as one table (length, first block, blocks, ids at, modalities
        # at), and the map as bytes: what the compiled loop's intake reads (stage_kernel.py)
        self.table = np.stack(
            [self.lengths, self.block_start, self.block_count, self.ids_at, self.mod_at], 1
        ).astype(np.int64)
        self.bytes = np.frombuffer(mapped, np.uint8)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray, list[Unit]]:
        """(ids, modalities, packing units) of document ``i``: views of the shard's map."""
        # .item(): a Python int straight away (int(array[i]) makes a numpy scalar first)
        length = self.lengths.item(i)
        ids = np.frombuffer(self.mapped, self.ids_dtype, length, self.ids_at.item(i))
        mod = np.frombuffer(self.mapped, self.mod_dtype, length, self.mod_at.item(i))
        count = self.block_count.item(i)
        if not count:
            return ids, mod, [Unit(0, length, False)] if length else []  # units_of, no block
        start = self.block_start.item(i)
        return ids, mod, units_of(length, self.index.blocks[start : start + count].tolist())


class IndexedShard:
    """A shard's documents as its index describes them (lengths and blocks), the same table as a
    ``CheckedShard``'s without where the tokens lie: what counting an epoch's batches reads (the
    packing decisions need nothing else; no tar is opened or checked)."""

    ids_dtype, mod_dtype = np.dtype("<i4"), np.dtype("u1")
    bytes = np.zeros(0, np.uint8)  # no tokens: a dry stream stages none

    def __init__(self, index: token_index.TokenIndex) -> None:
        records = index.records
        self.index = index
        self.table = np.zeros((len(records), 5), np.int64)
        self.table[:, 0] = records["tokens"]
        self.table[:, 1] = records["block_start"]
        self.table[:, 2] = records["block_count"]


def check_shard(
    mapped: memoryview,
    index: token_index.TokenIndex,
    *,
    shard_sha256: str,
    id_ranges: np.ndarray | None,
    check_hash: bool,
) -> CheckedShard | None:
    """The shard (``mapped``: the whole tar) when it passes the checks above; None when it does
    not (its documents are then read and checked one by one)."""
    from data.loader.npy import npy_layout  # the loader's header-cached .npy parser

    if check_hash and (
        not shard_sha256 or hashlib.sha256(mapped).hexdigest() != shard_sha256.lower()
    ):
        return None
    records = index.records
    ids_at, mod_at, all_ids, all_mod = [], [], [], []
    dtypes = set()
    try:
        for (i0, isz), (m0, msz), length in zip(
            records["ids"].tolist(), records["mod"].tolist(), records["tokens"].tolist()
        ):
            # Where the values lie, from the headers: arithmetic, not a pointer per array. Any
            # other kind of .npy (which np.load would copy out of the map) is read document by
            # document.
            ids_layout = npy_layout(mapped[i0 : i0 + isz])
            mod_layout = npy_layout(mapped[m0 : m0 + msz])
            if ids_layout is None or mod_layout is None:
                return None
            (ids_dtype, n_ids, ids_off), (mod_dtype, n_mod, mod_off) = ids_layout, mod_layout
            if n_ids != length or n_mod != length:
                return None
            if (
                ids_off + length * ids_dtype.itemsize > isz
                or mod_off + length * mod_dtype.itemsize > msz
            ):
                return None  # a short payload
            dtypes.add((ids_dtype, mod_dtype))
            ids_at.append(i0 + ids_off)
            mod_at.append(m0 + mod_off)
            all_ids.append(np.frombuffer(mapped, ids_dtype, length, i0 + ids_off))
            all_mod.append(np.frombuffer(mapped, mod_dtype, length, m0 + mod_off))
        if len(dtypes) > 1:
            return None  # not as tokenize writes shards: read document by document
        if all_ids and id_ranges is not None:
            check_ids(np.concatenate(all_ids), np.concatenate(all_mod), id_ranges)
    except (ValueError, EOFError):
        return None  # read document by document: the bad one is skipped and named there
    ids_dtype, mod_dtype = next(iter(dtypes)) if dtypes else (np.dtype("<i4"), np.dtype("u1"))
    return CheckedShard(mapped, index, ids_dtype, mod_dtype, ids_at, mod_at)
