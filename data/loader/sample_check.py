"""Checks on every sample the loader reads, so that one corrupted sample is skipped and counted
instead of crashing the run (the model's embedding would fail on an id past the vocabulary, at
the same step after every restart): the SHA-256 its index records over its members, and every
id against its modality's range (docs/loader.md, "Every sample is checked"). A failed check is
a ValueError: the stream skips, counts and names the sample like any unreadable one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from numba import njit

from data.loader import store
from data.loader.config import LoaderConfig
from data.vocab import Modality, VocabLayout

Buffer = bytes | memoryview
Reader = Callable[[int, int], Buffer]  # (offset, size) -> bytes of this sample's shard
_NO_HASH = bytes(32)  # an index without a usable per-sample hash


def attach_id_ranges(cfg: LoaderConfig, tables: list) -> None:
    """Give every table its modality ranges: from ``data.tokenizers`` when set, else the layout
    the token shards were made with (all sources share one, loader/dataset.check_tokenizers).
    Tables that have them (a run's, shared by its later loaders: the probes') keep them: the
    layout is read once, at start."""
    if tables and all(t.id_ranges is not None for t in tables):
        return
    if cfg.tokenizers:
        url = str(Path(cfg.tokenizers) / "vocab_layout.json")
    else:
        url = next((t.layout_url for t in tables if t.layout_url), "")
    if not url:
        return  # raw sources need data.tokenizers: refused at start elsewhere
    try:
        layout = VocabLayout.from_dict(json.loads(store.read_bytes(url)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{url}: the vocabulary layout of the loader's sources is unreadable ({e}); "
            "set data.tokenizers to the tokenizer folder"
        ) from None
    ranges = np.asarray(layout.modality_ranges(), np.int64)  # [modality, 2]
    for t in tables:
        t.id_ranges = ranges


_CODE = int(Modality.CODE)


@functools.lru_cache(maxsize=64)  # loaders come and go (tests): a few ranges at a time
def _shared_text(key: bytes) -> int:
    ranges = np.frombuffer(key, np.int64).reshape(-1, 2)
    text, code = ranges[int(Modality.TEXT)], ranges[_CODE]
    return int(text[1]) if text[0] == 0 and (text == code).all() else -1


def _text_below(ranges: np.ndarray) -> int:
    """The text size when text and code share the ids [0, text size) (a text or code document
    is then checked by its largest id alone), else -1."""
    return _shared_text(np.ascontiguousarray(ranges, np.int64).tobytes())


@njit(cache=True, nogil=True, inline="always")  # inlined into shard_check.first_bad_document
def first_bad_token(ids, mod, ranges, text_below):
    """The first token whose modality lies past ``ranges`` or whose id lies outside its
    modality's range [lo, hi) (0 when ``mod`` and ``ids`` differ in length); -1 when there is
    none. A document of text and code only with every id below ``text_below`` (``_text_below``;
    -1: no such shortcut) passes by two maxima, which LLVM vectorises; any other is checked token
    by token. The maxima read ids as uint32 (a negative id: past every range) and modalities as
    unsigned, so other dtypes pass -1."""
    length = ids.shape[0]
    if mod.shape[0] != length:
        return 0
    if text_below > 0:
        top_mod = np.uint8(0)
        top_id = np.uint32(0)
        for tok in range(length):
            top_mod = max(top_mod, mod[tok])
            top_id = max(top_id, np.uint32(ids[tok]))
        if top_mod <= _CODE and top_id < text_below:
            return -1
    for tok in range(length):
        modality = mod[tok]
        if modality < 0 or modality >= ranges.shape[0]:
            return tok
        token = ids[tok]
        if token < ranges[modality, 0] or token >= ranges[modality, 1]:
            return tok
    return -1


def check_ids(ids: np.ndarray, mod: np.ndarray, ranges: np.ndarray | None) -> None:
    """ValueError naming the first bad token when a modality or id lies outside the layout."""
    if ranges is None or not len(ids):
        return
    ranges = np.ascontiguousarray(ranges, np.int64)
    fast = ids.dtype.itemsize <= 4 and mod.dtype.kind == "u"  # what the two maxima read exactly
    if first_bad_token(ids, mod, ranges, _text_below(ranges) if fast else -1) < 0:
        return
    mod64, ids64 = mod.astype(np.int64), ids.astype(np.int64)
    bad_mod = (mod64 < 0) | (mod64 >= len(ranges))
    if bad_mod.any():
        i = int(np.flatnonzero(bad_mod)[0])
        raise ValueError(f"token {i}: modality {int(mod[i])} is not one of 0..{len(ranges) - 1}")
    lo, hi = ranges[mod64, 0], ranges[mod64, 1]
    bad = (ids64 < lo) | (ids64 >= hi)
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"{int(bad.sum())} id(s) outside their modality's range, the first: token {i} id "
        f"{int(ids[i])} as {Modality(int(mod[i])).name.lower()} (range "
        f"{int(lo[i])}..{int(hi[i]) - 1})"
    )


def read_members(members: Sequence, view: Reader, check_hash: bool) -> tuple[Buffer, Buffer]:
    """(ids.npy bytes, mod.npy bytes) of a token sample whose ``json``, ``ids.npy`` and
    ``mod.npy`` members lie at (offset, size) ``j0, jsz`` / ``i0, isz`` / ``m0, msz`` of its
    shard (``members``: those six and the SHA-256 of its index, as ``locate_members`` gives
    them; zeros: no hash), checked against the hash. One view of the shard covers the members
    (they lie side by side): a slice of a memory map for local shards, one ranged read for
    remote ones."""
    j0, jsz, i0, isz, m0, msz, sha256 = members
    hashed = check_hash and sha256 != _NO_HASH
    start, end = min(i0, m0), max(i0 + isz, m0 + msz)
    if hashed:
        start, end = min(start, j0), max(end, j0 + jsz)
    blob = memoryview(view(start, end - start))
    ids = blob[i0 - start : i0 - start + isz]
    mod = blob[m0 - start : m0 - start + msz]
    if hashed:
        # data.shards.writer.sample_hash, inlined: (name, size, bytes) of each member in name order
        h = hashlib.sha256(b"ids.npy\0%d\0" % isz)
        h.update(ids)
        h.update(b"json\0%d\0" % jsz)
        h.update(blob[j0 - start : j0 - start + jsz])
        h.update(b"mod.npy\0%d\0" % msz)
        h.update(mod)
        if h.digest() != sha256:
            raise ValueError("its members do not match the SHA-256 in the shard index (corrupted)")
    return ids, mod
