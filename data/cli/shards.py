"""``earlyfuse-prep stats`` and ``verify``: read and check a shard folder."""

from __future__ import annotations

import json

from data.cli.common import path_or_url


def _add_stats(sub) -> None:
    said = (
        "what a shard folder holds: a raw folder's samples, bytes, modalities, media sizes, reject "
        "reasons and exact duplicates; a token folder's documents, tokens and visual blocks per "
        "source and modality (a folder or an fsspec URL)"
    )
    p = sub.add_parser("stats", help=said, description=said)
    p.add_argument("dir", type=path_or_url, help="a raw or token shard folder, or its URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)


def cmd_stats(a) -> int:
    from data.shards.stats import collect_stats, format_stats

    s = collect_stats(a.dir)
    print(json.dumps(s, indent=1) if a.json else format_stats(s))
    return 0


def _add_verify(sub) -> None:
    said = (
        "re-hash shards against the manifest, check every index against its tar and every sample "
        "(raw folders: documents against the schema; token folders: ids within the vocabulary); "
        "a folder or an fsspec URL (shards are downloaded one at a time). Exit code 1 on a problem"
    )
    p = sub.add_parser("verify", help=said, description=said)
    p.add_argument("dir", type=path_or_url, help="a raw or token shard folder, or its URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)


def cmd_verify(a) -> int:
    from data.shards.verify import format_verify, verify

    r = verify(a.dir, progress=not (a.json or a.no_progress))
    print(json.dumps(r, indent=1) if a.json else format_verify(r))
    return 0 if r["ok"] else 1
