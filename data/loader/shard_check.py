"""Token shards checked whole, once, when a consumer first reads from them, so that their
documents are then handed out without any per-document check (issue 18: reading and checking
each document on its own was ~30 us of the loader's ~70 us a document).

Design choices:
- The shard-level digest is the SHA-256 of the whole tar that ``earlyfuse-prep tokenize`` (and
  the merge of its partitions) records in the manifest's shard line (``sha256``, the same value
  ``earlyfuse-prep verify`` checks). One ``hashlib`` call over the shard's memory map: C speed,
  and hashlib releases the GIL for large buffers, so a DataLoader worker's hashing does not
  hold up the trainer's thread.
- Then every document's ``.npy`` members are parsed once, their lengths compared with the index,
  and the ids of the whole shard checked against their modalities' vocabulary ranges in one
  vectorised pass (``check_ids`` over the concatenation).
- A shard that passes is kept as a list of ready documents (ids and modalities are views of
  the memory map, and the units the packer places): reading one is a list lookup.
- A shard that fails anything (tar changed since the manifest, a corrupted document, an id out
  of range), that has no shard digest (a folder written before, or a shard its manifest does
  not list), or that cannot be mapped (fsspec URLs: hashing would read the whole shard over
  the network) is read as before: each document read and checked on its own, so a bad
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

# (ids, modalities, packing units: data/loader/packer.units_of) of one document. Units are never
# changed by the packer (a Doc keeps its place in them), so one list serves every read.
ReadyDoc = tuple[np.ndarray, np.ndarray, list[Unit]]


def ready_documents(
    mapped: memoryview,
    index: token_index.TokenIndex,
    *,
    shard_sha256: str,
    id_ranges: np.ndarray | None,
    check_hash: bool,
) -> list[ReadyDoc] | None:
    """Every document of a shard (``mapped``: the whole tar), when the shard passes the checks
    above; None when it does not (its documents are then read and checked one by one)."""
    from data.loader.stream import read_npy  # the loader's header-cached .npy reader

    if check_hash and (
        not shard_sha256 or hashlib.sha256(mapped).hexdigest() != shard_sha256.lower()
    ):
        return None
    records = index.records
    ids_at, mod_at = records["ids"].tolist(), records["mod"].tolist()
    tokens = records["tokens"].tolist()
    block_start, block_count = records["block_start"].tolist(), records["block_count"].tolist()
    docs: list[ReadyDoc] = []
    try:
        for (i0, isz), (m0, msz), length, b0, nb in zip(
            ids_at, mod_at, tokens, block_start, block_count
        ):
            ids = read_npy(mapped[i0 : i0 + isz])
            mod = read_npy(mapped[m0 : m0 + msz])
            if ids.shape != (length,) or mod.shape != (length,):
                return None
            blocks = index.blocks[b0 : b0 + nb].tolist() if nb else []
            docs.append((ids, mod, units_of(length, blocks)))
        if docs and id_ranges is not None:
            check_ids(
                np.concatenate([doc[0] for doc in docs]),
                np.concatenate([doc[1] for doc in docs]),
                id_ranges,
            )
    except (ValueError, EOFError):
        return None  # read document by document: the bad one is skipped and named there
    return docs
