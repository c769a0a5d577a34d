"""``earlyfuse-prep verify DIR``: re-hash every shard against the manifest, check each index
against its tar (names, offsets, sizes, per-sample hashes) and each sample: a raw sample's JSON
against the schema; a token sample's spans, ids and modalities (lengths as the index says, every
id inside its modality's range of the folder's vocabulary layout). Nothing is trusted that is
not re-read. Raw folders (``earlyfuse-prep ingest``) and token folders (``earlyfuse-prep
tokenize``) alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.names import REJECTS_FILE
from data.schema import validate_doc
from data.shards.index import check_index, file_sha256, read_index
from data.shards.manifest import MANIFEST_FORMAT, load_manifest

TOKEN_FORMAT = "earlyfuse-token-shards"  # data/tokenize/run.py (not imported: it pulls in torch)


def _token_ranges(out: Path, m: dict, problems: list[str]) -> np.ndarray | None:
    from data.loader.sample_check import modality_ranges
    from data.vocab import VocabLayout

    path = out / m.get("tokenizers", {}).get("folder", "tokenizers") / "vocab_layout.json"
    try:
        return modality_ranges(VocabLayout.load(path))
    except ValueError as e:
        problems.append(f"{e}; token ids not checked against the vocabulary")
        return None


def _check_raw(tar: Path, e: dict, read) -> str | None:
    try:
        doc = json.loads(read("json"))
    except ValueError as err:
        return f"{e['key']}.json is not valid JSON ({err})"
    why = validate_doc(doc, set(e["members"]))
    return f"{e['key']}: {why}" if why else None


def _check_tokens(tar: Path, e: dict, read, ranges: np.ndarray | None) -> str | None:
    from data.loader.npy import read_npy
    from data.loader.sample_check import check_ids

    try:
        spans = json.loads(read("json")).get("spans")
        if not isinstance(spans, list):
            raise ValueError("no spans list")
    except (ValueError, AttributeError) as err:
        return f"{e['key']}.json is not a token document ({err})"
    try:
        ids, mod = read_npy(read("ids.npy")), read_npy(read("mod.npy"))
    except (ValueError, KeyError, EOFError) as err:
        return f"{e['key']}: unreadable ids/modalities ({err})"
    num_tokens = e.get("tokens")
    if ids.shape != (num_tokens,) or mod.shape != (num_tokens,):
        return (
            f"{e['key']}: {ids.shape[0]} ids / {mod.shape[0]} modalities, "
            f"the index says {num_tokens}"
        )
    try:
        check_ids(ids.astype(np.int64), mod.astype(np.int64), ranges)
    except ValueError as err:
        return f"{e['key']}: {err}"
    return None


def _check_binary_index(out: Path, shard: dict, idx: Path) -> list[str]:
    """The loader's binary index beside a token shard, when there is one, must be exactly the
    one its JSONL index gives (the loader would skip a stale one, at a rebuild's cost)."""
    from data.shards import token_index

    path = token_index.index_path_for(out / shard["path"])
    if not path.is_file():
        return []
    try:
        want = token_index.build(idx.read_bytes(), where=str(idx))
    except ValueError as e:
        return [str(e)]
    if path.read_bytes() != want:
        return [f"{path}: not the binary index of {idx.name} (earlyfuse-prep index rewrites it)"]
    return []


def verify(out: str | Path, *, progress: bool = False) -> dict:
    out = Path(out)
    manifest = load_manifest(out, formats=(MANIFEST_FORMAT, TOKEN_FORMAT))
    tokens = manifest["format"] == TOKEN_FORMAT
    problems: list[str] = []
    ranges = _token_ranges(out, manifest, problems) if tokens else None
    samples = 0
    for shard in tqdm(manifest["shards"], desc="verify", unit=" shards", disable=not progress):
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
        if tokens:
            problems += _check_binary_index(out, shard, idx)
        if len(index) != shard["samples"]:
            problems.append(f"{idx}: {len(index)} samples, the manifest says {shard['samples']}")
        found = check_index(tar, index)
        problems.extend(found)
        if any(not problem.endswith("does not match its hash") for problem in found):
            continue  # the tar does not match its index: its samples cannot be found
        with open(tar, "rb") as f:
            for entry in index:
                samples += 1

                def read(suffix, e=entry):
                    off, size = e["members"][suffix]
                    f.seek(off)
                    return f.read(size)

                try:
                    why = (
                        _check_tokens(tar, entry, read, ranges)
                        if tokens
                        else _check_raw(tar, entry, read)
                    )
                except KeyError as err:
                    why = f"{entry['key']}: member {err} missing"
                if why:
                    problems.append(f"{tar}: {why}")
    rejects = out / REJECTS_FILE
    n_rej = sum(1 for _ in open(rejects, encoding="utf-8")) if rejects.is_file() else 0
    if n_rej != manifest["totals"]["rejects"]:
        problems.append(
            f"{rejects}: {n_rej} lines, the manifest counts {manifest['totals']['rejects']}"
        )
    return {
        "folder": str(out),
        "format": manifest["format"],
        "shards": len(manifest["shards"]),
        "samples": samples,
        "problems": problems,
        "ok": not problems,
    }


def format_verify(r: dict) -> str:
    head = f"{r['folder']}: {r['shards']} shards, {r['samples']} samples checked"
    if r["ok"]:
        return head + ": OK"
    return (
        head
        + f": {len(r['problems'])} problem(s)\n"
        + "\n".join("  " + problem for problem in r["problems"])
    )
