"""Every sample of one source, from its token shards' indexes: where its members lie, its
token count and its visual blocks. Built once at start; no tar is opened.

Shard lists accept paths, globs, brace ranges and token folders. The fingerprint covers the
shard names, sizes and index hashes, and the tokenizers' fingerprint from the token manifest,
so loader state cannot be restored onto other data.
"""
from __future__ import annotations

import glob
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.loader.config import SourceConfig
from data.shards.index import index_path_for

_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def expand(pattern: str) -> list[str]:
    """Brace ranges ({000..041}, zero padding kept), then globs; a folder means its *.tar (deep)."""
    m = _BRACE.search(pattern)
    if m:
        a, b = m.group(1), m.group(2)
        width = len(a)
        out = []
        for i in range(int(a), int(b) + 1):
            out += expand(pattern[:m.start()] + str(i).zfill(width) + pattern[m.end():])
        return out
    p = Path(pattern)
    if p.is_dir():
        return sorted(str(x) for x in p.rglob("*.tar"))
    if any(c in pattern for c in "*?["):
        return sorted(glob.glob(pattern, recursive=True))
    return [pattern]


def find_token_manifest(tar: Path) -> dict | None:
    for parent in list(tar.parents)[:3]:
        m = parent / "manifest.json"
        if m.is_file():
            try:
                data = json.loads(m.read_text())
            except ValueError:
                return None
            return data if data.get("format") == "earlyfuse-token-shards" else None
    return None


@dataclass
class SampleTable:
    name: str
    shards: list[str]                   # tar paths
    shard: np.ndarray                   # int32 [N] shard of each sample
    keys: list[str]
    ids_at: np.ndarray                  # int64 [N, 2] offset, size of KEY.ids.npy
    mod_at: np.ndarray                  # int64 [N, 2]
    tokens: np.ndarray                  # int64 [N]
    blocks: list[list]                  # per sample: [[start, end, t, h, w], ...]
    fingerprint: str
    tokenizer_fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


def load_table(src: SourceConfig) -> SampleTable:
    tars: list[str] = []
    for pat in src.shards:
        found = expand(pat)
        if not found:
            raise ValueError(f"source {src.name}: {pat!r} matches no shard")
        tars += found
    if not tars:
        raise ValueError(f"source {src.name}: no shards given")
    shard, keys, ids_at, mod_at, tokens, blocks = [], [], [], [], [], []
    h = hashlib.sha256()
    tok_fp = set()
    for si, tar in enumerate(tars):
        tp = Path(tar)
        idx = index_path_for(tp)
        if not tp.is_file():
            raise ValueError(f"source {src.name}: shard {tar} does not exist")
        if not idx.is_file():
            raise ValueError(f"source {src.name}: shard {tar} has no index {idx.name}")
        raw_idx = idx.read_bytes()
        h.update(f"{tp.name}\0{tp.stat().st_size}\0".encode() + hashlib.sha256(raw_idx).digest())
        m = find_token_manifest(tp)
        if m is None:
            raise ValueError(f"source {src.name}: {tar} is not in a token shard folder (no manifest.json of "
                             "format earlyfuse-token-shards above it); tokenize raw shards first")
        tok_fp.add(json.dumps(m["tokenizers"], sort_keys=True))
        for lineno, line in enumerate(raw_idx.splitlines(), 1):
            try:
                e = json.loads(line)
                ids_at.append(e["members"]["ids.npy"])
                mod_at.append(e["members"]["mod.npy"])
                tokens.append(e["tokens"])
            except (ValueError, KeyError) as err:
                raise ValueError(f"{idx}:{lineno}: not a token shard index line ({err})") from None
            shard.append(si)
            keys.append(e["key"])
            blocks.append(e.get("blocks", []))
    if len(tok_fp) > 1:
        raise ValueError(f"source {src.name}: its shards were tokenized with different tokenizers")
    tfp = hashlib.sha256(next(iter(tok_fp)).encode()).hexdigest()[:16]
    return SampleTable(src.name, tars, np.asarray(shard, np.int32), keys, np.asarray(ids_at, np.int64).reshape(-1, 2),
                       np.asarray(mod_at, np.int64).reshape(-1, 2), np.asarray(tokens, np.int64), blocks,
                       h.hexdigest()[:16], tfp)
