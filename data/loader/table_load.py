"""Building a source's sample table (table.py) at start, from its shards and their manifest:
finding and checking the manifests, listing the shards, computing the fingerprints. No tar is
opened; which kind a source is (token or raw shards) is read from the manifest above the shards.
A token source starts from its manifest alone, in O(shards), and a shard it does not list, or
without its binary index, is refused naming it (docs/loader.md, "Start-up"). The fingerprint
covers the shard names and index hashes, not where they live: a run's state moves with its
shards to object storage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import posixpath
from collections.abc import Callable
from contextlib import suppress
from fnmatch import fnmatch

import numpy as np

from data.loader import store
from data.loader.config import SourceConfig
from data.loader.table import REBUILD, SampleTable, TokenTable
from data.names import MANIFEST_FILE
from data.shards import token_index
from data.shards.manifest import MANIFEST_FORMAT as RAW_FORMAT
from data.shards.manifest import TOKEN_FORMAT
from data.tokenize.vtok_files import tokenizer_key

# What a token manifest records of each shard, so that a loader's start reads no index
_ENTRY_FIELDS = ("samples", "index_sha256", "sha256", "blocks")


def find_manifest(url: str, seen: dict | None = None) -> tuple[dict, str, int] | None:
    """(manifest, its URL, how many folders above the shard's it is) of the shard folder ``url``
    lies in: the first ``manifest.json`` of a known format in its folder or the two above.
    ``seen`` caches reads across the shards of a source: shards of one folder (local or fsspec)
    share the answer, looked up once (a remote read or a command each)."""
    seen = {} if seen is None else seen
    folder = None if store.kind(url) == "pipe" else posixpath.dirname(url)
    if folder is not None and ("folder", folder) in seen:
        return seen[("folder", folder)]
    out = None
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
            out = (seen[m_url], m_url, up)
            break
    if folder is not None:
        seen[("folder", folder)] = out
    return out


def _no_manifest(url: str) -> str:
    """Why ``find_manifest`` found none for the shard ``url``: the nearest manifest.json that is
    there but unusable, or a local folder that a prep command began and did not finish."""
    for up in range(3):
        m_url = store.sibling(url, MANIFEST_FILE, up)
        with suppress(OSError):
            data = store.read_bytes(m_url)
            try:
                got = json.loads(data)
                what = f"has format {got.get('format')!r}" if got.get("format") else "has no format"
            except (ValueError, AttributeError):
                what = "is empty" if not data.strip() else "is not a JSON object"
            return f"{m_url} {what}: not a manifest of {TOKEN_FORMAT} or {RAW_FORMAT}"
        for work, command in ((".tokenize", "tokenize"), (".ingest", "ingest")):
            if store.kind(url) == "local" and os.path.isdir(store.sibling(url, work, up)):
                return (
                    f"{store.sibling(url, work, up)} holds the work of an earlyfuse-prep {command} "
                    f"that did not finish: run it again, or `earlyfuse-prep merge` its partitions"
                )
    return (
        f"no manifest.json of format {TOKEN_FORMAT} or {RAW_FORMAT} in its folder or the two above"
    )


def _listing(folder: str) -> set[str]:
    """The files of a local shard folder: one ``os.listdir`` per folder (cached per source by
    ``load_table``; a stat per shard was most of a start at 1,000 shards)."""
    try:
        return set(os.listdir(folder or "."))
    except OSError:
        return set()


def _listed(listing: Callable[[str], set[str]], path: str) -> bool:
    folder, base = os.path.split(path)
    return base in listing(folder)


def load_table(src: SourceConfig, *, cache_dir: str | None = None) -> SampleTable:
    """The sample table of one source: a ``TokenTable`` (token shards: the manifest alone, no
    per-sample work) or a ``SampleTable`` of raw shards (their JSONL indexes read whole).
    ``cache_dir``: where the binary indexes of remote shards are kept (default: the ``pipe:``
    cache, data.cache_dir)."""
    tars: list[str] = []
    listed: dict[str, str] = {}  # shard -> the pattern of the folder or glob that found it
    for pat in src.shards:
        matched = store.expand(pat)
        if not matched:
            raise ValueError(f"source {src.name}: {pat!r} matches no shard")
        tars += matched
        glob = any(c in pat for c in "*?[")
        if store.kind(pat) != "pipe" and (glob or not pat.endswith(".tar")):
            listed.update(dict.fromkeys(matched, pat if glob else "*"))
    if not tars:
        raise ValueError(f"source {src.name}: no shards given")
    seen: dict = {}
    found = []
    folders: dict = {}  # (manifest, shard folder in it) -> (manifest, a shard there, its pattern)
    listing = functools.cache(_listing)
    for tar in tars:
        local = store.kind(tar) == "local"
        if not (_listed(listing, tar) if local else store.exists(tar)):
            # the commonest cause: a relative path and a command run from another folder
            where = f" (relative to {os.getcwd()})" if local and not os.path.isabs(tar) else ""
            raise ValueError(f"source {src.name}: shard {tar} does not exist{where}")
        manifest_found = find_manifest(tar, seen)
        if manifest_found is None:
            _read_index(src, tar)  # a missing index is the first thing to name
            raise ValueError(
                f"source {src.name}: {tar} is in no shard folder ({_no_manifest(tar)})"
            )
        found.append(manifest_found)
        manifest, m_url, up = manifest_found
        if tar in listed:
            folders.setdefault(
                (m_url, posixpath.dirname(_relative(tar, up))), (manifest, tar, listed[tar])
            )
    have = set(tars)  # a folder or glob must find every shard its manifest lists there: one
    for (m_url, folder), (manifest, tar, names) in folders.items():  # gone would drop unsaid
        for path in (str(entry.get("path", "")) for entry in manifest.get("shards", [])):
            gone = posixpath.dirname(path) == folder and store.sibling(
                tar, posixpath.basename(path)
            )
            if gone and fnmatch(gone, names) and gone not in have:
                raise ValueError(f"source {src.name}: {gone} is missing, and {m_url} lists it")
    kinds = {f[0]["format"] for f in found}
    if len(kinds) > 1:
        raise ValueError(f"source {src.name}: mixes raw and token shards; make them two sources")
    if RAW_FORMAT in kinds:
        return _load_raw_table(src, tars, manifest_url=found[-1][1])
    return _load_token_table(src, tars, found, cache_dir or store.default_cache_dir(), listing)


def _read_index(src: SourceConfig, tar: str) -> bytes:
    idx = store.index_url(tar)
    try:
        return store.read_bytes(idx)
    except OSError as err:
        raise ValueError(
            f"source {src.name}: shard {tar} has no readable index {idx} ({err})"
        ) from None


def _relative(tar: str, up: int) -> str:
    """The shard's path relative to its manifest's folder, ``up`` folders above its own (how
    the manifest names it)."""
    path = store._tar_word(tar).group(1) if store.kind(tar) == "pipe" else tar
    return "/".join(path.split("/")[-(up + 1) :])


def _load_token_table(
    src: SourceConfig,
    tars: list[str],
    found: list[tuple[dict, str, int]],
    cache_dir: str,
    listing: Callable[[str], set[str]],
) -> TokenTable:
    """Token shards from their manifest's entries (samples, index SHA-256, blocks): no index is
    read (what is refused, naming it: the module's docstring)."""
    h = hashlib.sha256()
    counts, shas, shard_blocks, tar_shas = [], [], [], []
    tok_keys = set()
    layout_url = ""
    entries: dict[str, dict[str, dict]] = {}
    for tar, (m, manifest_url, up) in zip(tars, found):
        if manifest_url not in entries:  # once per manifest, not per shard
            entries[manifest_url] = {e.get("path", ""): e for e in m.get("shards", [])}
            tok_keys.add(tokenizer_key(m["tokenizers"]))
        entry = entries[manifest_url].get(_relative(tar, up))
        if entry is None:
            _read_index(src, tar)  # a shard that is not there is the first thing to name
            if store.kind(tar) == "pipe" and any(c in _relative(tar, up) for c in "*?["):
                raise ValueError(
                    f"source {src.name}: {tar}: a pipe: command must print one shard: no glob "
                    "in it (list the shards one by one)"
                )
            raise ValueError(
                f"source {src.name}: {tar} is not listed in {manifest_url}: the folder changed "
                f"after it was written; {REBUILD}"
            )
        missing = [name for name in _ENTRY_FIELDS if name not in entry]
        if missing:
            raise ValueError(
                f"source {src.name}: {manifest_url} lists {tar} without {', '.join(missing)}; "
                f"{REBUILD}"
            )
        if store.kind(tar) == "local":
            binary = store.beside(tar, token_index.SUFFIX)
            if not _listed(listing, binary):
                raise ValueError(f"source {src.name}: {binary} does not exist; {REBUILD}")
        sha = entry["index_sha256"]
        counts.append(int(entry["samples"]))
        shas.append(sha)
        tar_shas.append(str(entry["sha256"]))
        shard_blocks.append(entry["blocks"])
        # Name and index (every member's offset, size and hash), not the URL: the same shards
        # moved to object storage keep their fingerprint, and a run's state moves with them.
        h.update(f"{store.name(tar)}\0".encode() + bytes.fromhex(sha))
        if not layout_url:
            folder = m["tokenizers"].get("folder", "tokenizers")
            layout_url = store.sibling(tar, f"{folder}/vocab_layout.json", up)
    if len(tok_keys) > 1:
        raise ValueError(f"source {src.name}: its shards were tokenized with different tokenizers")
    return TokenTable(
        src.name,
        tars,
        counts,
        shas,
        fingerprint=h.hexdigest()[:16],
        tokenizer_fingerprint=next(iter(tok_keys)),
        manifest_url=found[-1][1],
        layout_url=layout_url,
        cache_dir=cache_dir,
        shard_blocks=shard_blocks,
        shard_sha256=tar_shas,
        tokenize_options=found[0][0].get("options"),
    )


def _load_raw_table(src: SourceConfig, tars: list[str], *, manifest_url: str) -> SampleTable:
    """Raw shards: every JSONL index read whole (each sample's members, for online tokenizing)."""
    shard, keys, members = [], [], []
    shard_bytes = [0] * len(tars)
    h = hashlib.sha256()
    for si, tar in enumerate(tars):
        raw_idx = _read_index(src, tar)
        idx = store.index_url(tar)
        h.update(f"{store.name(tar)}\0".encode() + hashlib.sha256(raw_idx).digest())
        last = -1
        for lineno, line in enumerate(raw_idx.splitlines(), 1):
            try:
                e = json.loads(line)
                if "json" not in e["members"]:
                    raise KeyError("members.json")
                members.append(e["members"])
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
                raise ValueError(f"{idx}:{lineno}: not a raw shard index line ({err})") from None
            shard.append(si)
    n = len(shard)
    return SampleTable(
        src.name,
        tars,
        np.asarray(shard, np.int32),
        keys,
        np.zeros(n, np.int64),
        [[] for _ in range(n)],
        h.hexdigest()[:16],
        "",
        kind="raw",
        members=members,
        manifest_url=manifest_url,
        shard_bytes=shard_bytes,
    )
