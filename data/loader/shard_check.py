"""Token shards checked whole, once, when a consumer first reads from them, so that their
documents are then handed out without any per-document check (checking each document on its
own costs about as much as the rest of the loader's work on it). What is checked, and which
shards are read document by document instead: docs/loader.md, "Shards checked whole".

- Members stored otherwise than tokenize writes them (int32 ids, uint8 modalities) send the
  shard to the per-document path, which reads any ``.npy`` integer array.
- ``check_shard`` reads only its arguments, so a stream runs it for its next shard in a thread
  while it reads the current one (stream.ConsumerStream._check_ahead).
"""

from __future__ import annotations

import hashlib

import numpy as np
from numba import njit

from data.loader.pack_kernel import units_of
from data.loader.sample_check import _text_below, first_bad_token
from data.shards import token_index
from data.shards.npy import npy_layouts

_IDS, _MOD = np.dtype("<i4"), np.dtype("u1")  # what tokenize writes (ids, modalities)


class CheckedShard:
    """A shard that passed the whole-shard check: its documents, read without further checks; or
    (``of_index``) a shard as its index describes it, for counting an epoch's batches."""

    def __init__(
        self,
        mapped: memoryview,
        index: token_index.TokenIndex,
        ids_at: np.ndarray,
        mod_at: np.ndarray,
    ) -> None:
        self.mapped, self.index = mapped, index
        # Per document: length, first block, blocks, where its ids and modalities start in the
        # map; and the map as bytes: what the compiled loop's intake reads (stage_kernel.py)
        counts = [index.records[name] for name in ("tokens", "block_start", "block_count")]
        self.table = np.stack([*counts, ids_at, mod_at], 1).astype(np.int64)
        self.bytes = np.frombuffer(mapped, np.uint8)

    @classmethod
    def of_index(cls, index: token_index.TokenIndex) -> CheckedShard:
        """The shard's documents as its index describes them, lengths and blocks without tokens:
        all the packing decisions read (no tar is opened or checked)."""
        no_tokens = np.zeros(len(index), np.int64)
        return cls(memoryview(b""), index, no_tokens, no_tokens)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, modalities, packing units) of document ``i``: views of the shard's map."""
        length, start, count, ids_at, mod_at = self.table[i].tolist()
        ids = np.frombuffer(self.mapped, _IDS, length, ids_at)
        mod = np.frombuffer(self.mapped, _MOD, length, mod_at)
        return ids, mod, units_of(length, self.index.blocks[start : start + count].tolist())


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
    if check_hash and (
        not shard_sha256 or hashlib.sha256(mapped).hexdigest() != shard_sha256.lower()
    ):
        return None
    records = index.records
    if not len(records):
        return CheckedShard(mapped, index, np.zeros(0, np.int64), np.zeros(0, np.int64))
    shard_bytes = np.frombuffer(mapped, np.uint8)
    lengths = records["tokens"].astype(np.int64)
    # Where the values lie, from the headers: arithmetic, not a pointer per array. Any other
    # kind of .npy (which np.load would copy out of the map) is read document by document.
    ids = npy_layouts(shard_bytes, records["ids"][:, 0], records["ids"][:, 1])
    mod = npy_layouts(shard_bytes, records["mod"][:, 0], records["mod"][:, 1])
    if ids is None or mod is None:
        return None
    (ids_dtype, n_ids, ids_at), (mod_dtype, n_mod, mod_at) = ids, mod
    if not (np.array_equal(n_ids, lengths) and np.array_equal(n_mod, lengths)):
        return None
    if (ids_dtype, mod_dtype) != (_IDS, _MOD):
        return None  # not as tokenize writes shards: read document by document
    if id_ranges is not None:
        ranges = np.ascontiguousarray(id_ranges, np.int64)
        text_below = _text_below(id_ranges)
        if first_bad_document(shard_bytes, ids_at, mod_at, lengths, ranges, text_below) >= 0:
            return None  # read document by document: the bad one is skipped and named there
    return CheckedShard(mapped, index, ids_at, mod_at)


@njit(cache=True, nogil=True)  # nogil: a check running ahead in a thread (stream.py)
def first_bad_document(shard_bytes, ids_at, mod_at, lengths, ranges, text_below):
    """The first document (int32 ids at ``ids_at``, uint8 modalities at ``mod_at`` of the
    shard's bytes) that runs past the shard or holds a bad token (``first_bad_token``, inlined);
    -1 when there is none."""
    for doc in range(lengths.shape[0]):
        length = lengths[doc]
        ids = shard_bytes[ids_at[doc] : ids_at[doc] + 4 * length].view(np.int32)
        mod = shard_bytes[mod_at[doc] : mod_at[doc] + length]
        if ids.shape[0] != length or first_bad_token(ids, mod, ranges, text_below) >= 0:
            return doc
    return -1
