"""``earlyfuse-prep verify DIR``: re-hash every shard against the manifest, check each index
against its tar (names, offsets, sizes, per-sample hashes) and each sample's JSON against
the schema. Nothing is trusted that is not re-read."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from data.names import REJECTS_FILE
from data.schema import validate_doc
from data.shards.index import check_index, file_sha256, read_index
from data.shards.manifest import load_manifest


def verify(out: str | Path, *, progress: bool = False) -> dict:
    out = Path(out)
    m = load_manifest(out)
    problems: list[str] = []
    samples = 0
    for shard in tqdm(m["shards"], desc="verify", unit=" shards", disable=not progress):
        tar, idx = out / shard["path"], out / shard["index"]
        if not tar.is_file() or not idx.is_file():
            problems.append(f"{tar if not tar.is_file() else idx}: missing")
            continue
        if file_sha256(tar) != shard["sha256"]:
            problems.append(f"{tar}: SHA-256 differs from the manifest")
        if file_sha256(idx) != shard["index_sha256"]:
            problems.append(f"{idx}: SHA-256 differs from the manifest")
        try:
            index = read_index(idx)
        except ValueError as e:
            problems.append(str(e))
            continue
        if len(index) != shard["samples"]:
            problems.append(f"{idx}: {len(index)} samples, the manifest says {shard['samples']}")
        found = check_index(tar, index)
        problems.extend(found)
        if found:
            continue
        with open(tar, "rb") as f:
            for entry in index:
                samples += 1
                off, size = entry["members"]["json"]
                f.seek(off)
                try:
                    doc = json.loads(f.read(size))
                except ValueError as err:
                    problems.append(f"{tar}: {entry['key']}.json is not valid JSON ({err})")
                    continue
                why = validate_doc(doc, set(entry["members"]))
                if why:
                    problems.append(f"{tar}: {entry['key']}: {why}")
    rejects = out / REJECTS_FILE
    n_rej = sum(1 for _ in open(rejects, encoding="utf-8")) if rejects.is_file() else 0
    if n_rej != m["totals"]["rejects"]:
        problems.append(f"{rejects}: {n_rej} lines, the manifest counts {m['totals']['rejects']}")
    return {
        "folder": str(out),
        "shards": len(m["shards"]),
        "samples": samples,
        "problems": problems,
        "ok": not problems,
    }


def format_verify(r: dict) -> str:
    head = f"{r['folder']}: {r['shards']} shards, {r['samples']} samples checked"
    if r["ok"]:
        return head + ": OK"
    return (
        head + f": {len(r['problems'])} problem(s)\n" + "\n".join("  " + p for p in r["problems"])
    )
