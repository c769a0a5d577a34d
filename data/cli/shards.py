"""``earlyfuse-prep stats``, ``verify`` and ``index``: read, check and index a shard folder."""

from __future__ import annotations

import json
from pathlib import Path

from data.cli.common import path_or_url


def _add_stats(sub) -> None:
    p = sub.add_parser(
        "stats",
        help="what a shard folder holds: a raw folder's samples, bytes, modalities, media sizes "
        "and reject reasons; a token folder's documents, tokens and visual blocks per source and "
        "modality (a folder or an fsspec URL)",
    )
    p.add_argument("dir", type=path_or_url, help="a raw or token shard folder, or its URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)


def cmd_stats(a) -> int:
    from data.shards.stats import collect_stats, format_stats

    s = collect_stats(a.dir)
    print(json.dumps(s, indent=1) if a.json else format_stats(s))
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-hash shards against the manifest, check every index against its tar and every "
        "sample (raw folders: documents against the schema; token folders: ids within the "
        "vocabulary); a folder or an fsspec URL (shards are downloaded one at a time)",
    )
    p.add_argument("dir", type=path_or_url, help="a raw or token shard folder, or its URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)


def cmd_verify(a) -> int:
    from data.shards.verify import format_verify, verify

    r = verify(a.dir, progress=not a.json)
    print(json.dumps(r, indent=1) if a.json else format_verify(r))
    return 0 if r["ok"] else 1


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="write the loader's binary index (SHARD.idx.bin) beside every shard of a token "
        "folder made before binary indexes, and each shard's block summary into its manifest "
        "(a loader then starts without reading any index; without this it builds them into "
        "its cache on first use)",
    )
    p.add_argument("dir", type=Path, help="a token folder (earlyfuse-prep tokenize --out)")
    p.set_defaults(func=cmd_index)


def cmd_index(a) -> int:
    from data.shards.token_index import index_folder

    r = index_folder(a.dir)
    print(f"{r['folder']}: {r['written']} of {r['shards']} binary indexes written")
    return 0
