"""Every sample of one source, from its shards' indexes: where its members lie, its token count
and its visual blocks. Built once at start; no tar is opened.

A source is either *token* shards (``earlyfuse-prep tokenize``: ids and modalities stored, the
fast path) or *raw* shards (``earlyfuse-prep ingest``: documents and media, tokenized online in
the loader's workers). Which one is read from the manifest above the shards. Shards may be local
paths, fsspec URLs or ``pipe:`` commands (data/loader/store.py).

The fingerprint covers the shard names and index hashes (not where they live); the tokenizer fingerprint the
text tokenizer, vocabulary layout and visual tokenizer weights. Loader state cannot be restored
onto other data, and sources made with other tokenizers cannot be mixed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data.loader import store
from data.loader.config import SourceConfig
from data.names import MANIFEST_FILE

TOKEN_FORMAT = "earlyfuse-token-shards"
RAW_FORMAT = "earlyfuse-raw-shards"


def expand(pattern: str) -> list[str]:
    return store.expand(pattern)


def find_manifest(url: str, seen: dict | None = None) -> tuple[dict, str] | None:
    """(manifest, its URL) of the shard folder ``url`` lies in: the first ``manifest.json`` of a
    known format in its folder or the two above. ``seen`` caches reads across the shards of a
    source (one read per folder, not per shard: a remote read or a command each)."""
    seen = {} if seen is None else seen
    for up in range(3):
        m_url = store.sibling(url, MANIFEST_FILE, up)
        if m_url not in seen:
            try:
                data = json.loads(store.read_bytes(m_url))
            except (OSError, ValueError):
                data = None
            ok = isinstance(data, dict) and data.get("format") in (TOKEN_FORMAT, RAW_FORMAT)
            seen[m_url] = data if ok else None
        if seen[m_url] is not None:
            return seen[m_url], m_url
    return None


def tokenizer_key(tokenizers: dict) -> str:
    """One string for a manifest's ``tokenizers`` entry (the folder's name left out)."""
    return json.dumps({k: tokenizers[k] for k in ("text", "layout", "visual")}, sort_keys=True)


@dataclass
class SampleTable:
    name: str
    shards: list[str]  # shard URLs
    shard: np.ndarray  # int32 [N] shard of each sample
    keys: list[str]
    ids_at: np.ndarray  # int64 [N, 2] offset, size of KEY.ids.npy (token shards)
    mod_at: np.ndarray  # int64 [N, 2]
    tokens: np.ndarray  # int64 [N] (raw shards: 0, known only once tokenized)
    blocks: list[list]  # per sample: [[start, end, t, h, w], ...] (raw: empty)
    fingerprint: str
    tokenizer_fingerprint: str  # tokenizer_key(...) of token shards; "" for raw shards
    kind: str = "tokens"  # tokens | raw
    # The fingerprint the loader computed before remote shards (names, sizes, index hashes; the
    # manifest's tokenizers entry whole): states saved then still resume. Local token shards only.
    legacy_fingerprint: str = ""
    shard_bytes: list[int] = field(default_factory=list)  # per shard: where its last member ends
    members: list[dict] = field(default_factory=list)  # raw: each sample's index members
    manifest_url: str = ""
    # Token shards: where each sample's KEY.json lies and the SHA-256 of its members (the index's
    # per-sample hash; all zero where the index has none), checked as the sample is read
    # (data/loader/sample_check.py).
    json_at: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    sha: np.ndarray = field(default_factory=lambda: np.zeros((0, 32), np.uint8))
    layout_url: str = ""  # the vocabulary layout the token shards were made with
    # [modality, 2]: the id range [lo, hi) of each modality (set by the loader at start)
    id_ranges: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.shard)


def load_table(src: SourceConfig) -> SampleTable:
    tars: list[str] = []
    for pat in src.shards:
        matched = expand(pat)
        if not matched:
            raise ValueError(f"source {src.name}: {pat!r} matches no shard")
        tars += matched
    if not tars:
        raise ValueError(f"source {src.name}: no shards given")
    shard, keys, ids_at, mod_at, tokens, blocks, members = [], [], [], [], [], [], []
    json_at, sha = [], []
    layout_url = ""
    shard_bytes = [0] * len(tars)
    h = hashlib.sha256()
    kinds, tok_keys = set(), set()
    manifest_url = ""
    seen: dict = {}
    legacy = hashlib.sha256()
    legacy_tok = set()
    for si, tar in enumerate(tars):
        if not store.exists(tar):
            raise ValueError(f"source {src.name}: shard {tar} does not exist")
        idx = store.index_url(tar)
        try:
            raw_idx = store.read_bytes(idx)
        except OSError as err:
            raise ValueError(
                f"source {src.name}: shard {tar} has no readable index {idx} ({err})"
            ) from None
        # Name and index (every member's offset, size and hash), not the URL: the same shards
        # moved to object storage keep their fingerprint, and a run's state moves with them.
        h.update(f"{store.name(tar)}\0".encode() + hashlib.sha256(raw_idx).digest())
        if store.kind(tar) == "local":
            legacy.update(
                f"{store.name(tar)}\0{Path(tar).stat().st_size}\0".encode()
                + hashlib.sha256(raw_idx).digest()
            )
        manifest_found = find_manifest(tar, seen)
        if manifest_found is None:
            raise ValueError(
                f"source {src.name}: {tar} is in no shard folder (no manifest.json of format "
                f"{TOKEN_FORMAT} or {RAW_FORMAT} in its folder or the two above)"
            )
        m, manifest_url = manifest_found
        kinds.add(m["format"])
        if m["format"] == TOKEN_FORMAT:
            if not layout_url:
                ups = [
                    u for u in range(3) if store.sibling(tar, "manifest.json", u) == manifest_url
                ]
                up = ups[0] if ups else 0
                folder = m["tokenizers"].get("folder", "tokenizers")
                layout_url = store.sibling(tar, f"{folder}/vocab_layout.json", up)
            tok_keys.add(tokenizer_key(m["tokenizers"]))
            legacy_tok.add(json.dumps(m["tokenizers"], sort_keys=True))
        raw = m["format"] == RAW_FORMAT
        last = -1
        for lineno, line in enumerate(raw_idx.splitlines(), 1):
            try:
                e = json.loads(line)
                if raw:
                    if "json" not in e["members"]:
                        raise KeyError("members.json")
                    members.append(e["members"])
                else:
                    ids_at.append(e["members"]["ids.npy"])
                    mod_at.append(e["members"]["mod.npy"])
                    json_at.append(e["members"].get("json", [0, 0]))
                    # The hash covers every member: checkable from these three only
                    whole = set(e["members"]) == {"json", "ids.npy", "mod.npy"}
                    sha.append(bytes.fromhex(e["sha256"]) if whole and "sha256" in e else bytes(32))
                    tokens.append(e["tokens"])
                    blocks.append(e.get("blocks", []))
                keys.append(e["key"])
                first = min(int(o) for o, _ in e["members"].values())
                if first <= last:
                    raise ValueError(
                        f"offsets go back at sample {e['key']}: this is not one shard's index (a "
                        "pipe: command must print one shard: no glob in it)"
                    )
                last = max(int(o) + int(n) for o, n in e["members"].values())
                shard_bytes[si] = max(shard_bytes[si], last)
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{idx}:{lineno}: not a {'raw' if raw else 'token'} shard index line ({err})"
                ) from None
            shard.append(si)
    if len(kinds) > 1:
        raise ValueError(f"source {src.name}: mixes raw and token shards; make them two sources")
    if len(tok_keys) > 1:
        raise ValueError(f"source {src.name}: its shards were tokenized with different tokenizers")
    n = len(shard)
    raw = RAW_FORMAT in kinds
    old = ""
    if not raw and len(legacy_tok) == 1 and all(store.kind(t) == "local" for t in tars):
        old = json.dumps(
            [
                legacy.hexdigest()[:16],
                hashlib.sha256(next(iter(legacy_tok)).encode()).hexdigest()[:16],
            ]
        )
    return SampleTable(
        src.name,
        tars,
        np.asarray(shard, np.int32),
        keys,
        np.asarray(ids_at, np.int64).reshape(-1, 2),
        np.asarray(mod_at, np.int64).reshape(-1, 2),
        np.zeros(n, np.int64) if raw else np.asarray(tokens, np.int64),
        [[] for _ in range(n)] if raw else blocks,
        h.hexdigest()[:16],
        "" if raw else next(iter(tok_keys)),
        kind="raw" if raw else "tokens",
        members=members,
        manifest_url=manifest_url,
        legacy_fingerprint=old,
        shard_bytes=shard_bytes,
        json_at=np.asarray(json_at, np.int64).reshape(-1, 2),
        sha=np.frombuffer(b"".join(sha), np.uint8).reshape(-1, 32).copy(),
        layout_url=layout_url,
    )
