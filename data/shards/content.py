"""Content fingerprints of raw documents: what a held-out set must not share with training.

A document's fingerprints are short hashes of
- ``d:`` the whole content: every segment's type and text, or its media bytes, in order (the
  key, source, origin and metadata are left out: the same photo with the same caption under
  another name is the same document);
- ``m:`` each media member's bytes (a photo that is in training alone is not held out inside
  an interleaved page either);
- ``t:`` each text or code segment of at least ``MIN_TEXT_CHARS`` characters (a docstring copied
  into another document). Shorter texts are left out on purpose: captions ("a handwritten digit
  7", a three-shape scene's 160 characters) and template sentences recur by design, with
  different pictures.

``earlyfuse-prep ingest`` writes them into every raw index line (``"content"``) and, with
``--exclude-content-of TRAIN_RAW``, rejects (``duplicate-of-excluded``) every document that shares
one with that folder. A raw index without them was not written by ingest and is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from data.schema import Sample

MIN_TEXT_CHARS = 200
DIGEST_CHARS = 16  # 64 bits: collisions are out of reach at any corpus size we index


def _h(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def fingerprints(segments: list[dict], media: dict[str, bytes]) -> list[str]:
    """Fingerprints of one document from its segments and its media members' bytes."""
    whole = hashlib.sha256()
    out = []
    for seg in segments:
        t = seg.get("type", "")
        if "member" in seg:
            digest = _h(media[seg["member"]])
            whole.update(f"{t}\0m{digest}\0".encode())
            out.append(f"m:{digest}")
        else:
            text = str(seg.get("text", ""))
            whole.update(f"{t}\0t".encode() + text.encode("utf-8") + b"\0")
            if len(text) >= MIN_TEXT_CHARS:
                out.append(f"t:{_h(text.encode('utf-8'))}")
    return [f"d:{whole.hexdigest()[:DIGEST_CHARS]}", *dict.fromkeys(out)]


def media_fingerprint(data: bytes) -> str:
    """The ``m:`` fingerprint of one media file's bytes."""
    return f"m:{_h(data)}"


def sample_fingerprints(sample: Sample) -> list[str]:
    return fingerprints(sample.doc["segments"], dict(sample.media))


def describe(fp: str) -> str:
    return {"d": "whole document", "m": "a media member", "t": "a text segment"}[fp[0]]


def repeat_of(first_of: dict[str, str], entry: dict, where: str) -> str | None:
    """The ``source:key`` of the earlier document whose whole content the raw index ``entry``
    repeats (``first_of``: whole-document fingerprint -> its first ``source:key``); None, and
    ``where`` remembered, when it is the first."""
    whole = (entry.get("content") or [None])[0]
    if whole is None:
        return None
    kept = first_of.setdefault(whole, where)
    return None if kept == where else kept


def folder_fingerprints(raw_dir: str | Path) -> dict[str, str]:
    """Every fingerprint of a raw shard folder -> the first ``source:key`` that has it."""
    from data.shards.reader import iter_shard, shard_entries

    found: dict[str, str] = {}
    for tar, index, entry in shard_entries(raw_dir):
        for doc in iter_shard(tar, index):
            if "content" not in doc.entry:
                raise ValueError(
                    f"{index}: {doc.key} has no content fingerprints: not a raw index that "
                    "earlyfuse-prep ingest wrote; ingest that corpus again"
                )
            for fp in doc.entry["content"]:
                found.setdefault(fp, f"{entry['source']}:{doc.key}")
    return found
