"""Checks on every sample the loader reads, so that one corrupted sample is skipped and counted
instead of crashing the run (the model's embedding would fail on an id past the vocabulary, at
the same step after every restart).

Design choices:
- Token samples are checked against the SHA-256 their index records (``sample_hash`` over the
  ``json``, ``ids.npy`` and ``mod.npy`` members). The three members lie next to each other in
  the tar, so they are read in one read (instead of two for ids and modalities); the extra cost
  is hashing a few KB per document (docs/benchmarks.md, ``tools/bench/bench_sample_check.py``).
  ``data.check_hashes=false`` turns it off.
- Ids are always checked against their modality's range of the vocabulary layout (text and
  code: the BPE; image and video: the visual codes; structure: the markers): a vectorised
  compare, microseconds. It also guards raw sources tokenized online.
- A failed check is a ValueError: the stream skips the sample, counts it in ``data/skipped``
  and logs its shard and key, like any unreadable sample.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data.loader import store
from data.loader.config import LoaderConfig
from data.vocab import Modality, VocabLayout

Reader = Callable[[int, int], bytes]  # (offset, size) -> bytes of this sample's shard


def modality_ranges(layout: VocabLayout) -> np.ndarray:
    """[modality, 2]: the ids [lo, hi) each modality may hold."""
    out = np.zeros((len(Modality), 2), np.int64)
    out[Modality.TEXT] = out[Modality.CODE] = (0, layout.text_size)
    out[Modality.IMAGE] = out[Modality.VIDEO] = (layout.visual_offset, layout.size)
    out[Modality.STRUCTURE] = (layout.structure_offset, layout.visual_offset)
    return out


def attach_id_ranges(cfg: LoaderConfig, tables: list) -> None:
    """Give every table its modality ranges: from ``data.tokenizers`` when set, else the layout
    the token shards were made with (all sources share one, loader/dataset.check_tokenizers)."""
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
    ranges = modality_ranges(layout)
    for t in tables:
        t.id_ranges = ranges


_BITS: dict[bytes, np.ndarray] = {}  # ranges -> per id, a bit for each modality it may carry


def _allowed_bits(ranges: np.ndarray) -> np.ndarray:
    """uint8 [vocabulary + 1]: bit m of entry i says id i may carry modality m; the last entry,
    0, stands for every id past the vocabulary (lookups clip to it)."""
    key = ranges.tobytes()
    if key not in _BITS:
        bits = np.zeros(int(ranges[:, 1].max()) + 1, np.uint8)
        for m, (lo, hi) in enumerate(ranges):
            bits[lo:hi] |= np.uint8(1 << m)
        _BITS[key] = bits
    return _BITS[key]


def check_ids(ids: np.ndarray, mod: np.ndarray, ranges: np.ndarray | None) -> None:
    """ValueError naming the first bad token when a modality or id lies outside the layout."""
    if ranges is None or not len(ids):
        return
    bits = _allowed_bits(ranges)
    # Four whole-array passes. Ids seen as unsigned: a negative one is huge, so the clipped
    # lookup sends it, like any id past the vocabulary, to the last entry (no bits); a modality
    # past the 5 bits shifts to 0. Signed modalities (the raw path's int64) are checked >= 0.
    unsigned = ids.view(ids.dtype.str.replace("i", "u")) if ids.dtype.kind == "i" else ids
    if (mod.dtype.kind == "u" or int(mod.min()) >= 0) and (
        (bits.take(unsigned, mode="clip") >> mod) & 1
    ).all():
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


def read_token_sample(t, sample: int, read: Reader, *, check_hash: bool) -> tuple[bytes, bytes]:
    """(ids.npy bytes, mod.npy bytes) of a token sample, checked against its index hash."""
    ids_at, mod_at = t.ids_at[sample], t.mod_at[sample]
    digest = t.sha[sample].tobytes() if check_hash and len(t.sha) else bytes(32)
    if digest == bytes(32):  # not asked for, or an index without the hash
        return read(int(ids_at[0]), int(ids_at[1])), read(int(mod_at[0]), int(mod_at[1]))
    json_at = t.json_at[sample]
    start = int(min(json_at[0], ids_at[0], mod_at[0]))
    end = int(max(json_at.sum(), ids_at.sum(), mod_at.sum()))
    blob = memoryview(read(start, end - start))
    # data.shards.writer.sample_hash, inlined: (name, size, bytes) of each member in name order
    h = hashlib.sha256()
    for name, (off, size) in ((b"ids.npy", ids_at), (b"json", json_at), (b"mod.npy", mod_at)):
        h.update(b"%s\0%d\0" % (name, size))
        h.update(blob[off - start : off - start + size])
    if h.digest() != digest:
        raise ValueError("its members do not match the SHA-256 in the shard index (corrupted)")
    i0, m0 = int(ids_at[0]) - start, int(mod_at[0]) - start
    return bytes(blob[i0 : i0 + int(ids_at[1])]), bytes(blob[m0 : m0 + int(mod_at[1])])
