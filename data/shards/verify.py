"""``earlyfuse-prep verify DIR``: re-hash every shard against the manifest, check each index
against its tar (names, offsets, sizes, per-sample hashes) and each sample: a raw sample's JSON
against the schema; a token sample's spans, ids and modalities (lengths as the index says, every
id inside its modality's range of the folder's vocabulary layout, the index's blocks and counts
as the sample gives them); of a token folder also the manifest's per-shard summaries and the
tokenizers/ folder, which training reads instead. Nothing is trusted that is not re-read. Raw folders (``earlyfuse-prep ingest``) and token folders (``earlyfuse-prep
tokenize``) alike, local or at an fsspec URL (``s3://bucket/tokens``): a remote shard is
downloaded whole to a temporary folder (every byte is hashed anyway: one GET is the cheapest
read), checked there and deleted before the next, and named by its URL in every problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.names import MANIFEST_FILE, REJECTS_FILE
from data.schema import validate_doc
from data.shards.index import check_index, file_sha256, read_index
from data.shards.manifest import MANIFEST_FORMAT, TOKEN_FORMAT, load_manifest
from data.shards.storage import Folder, PrivateTemp
from data.tokenize.blocks import shard_block_stats, visual_blocks
from data.vocab import MODALITY_NAMES


def _token_ranges(folder: Folder, m: dict, problems: list[str]) -> np.ndarray | None:
    from data.vocab import VocabLayout

    rel = f"{m.get('tokenizers', {}).get('folder', 'tokenizers')}/vocab_layout.json"
    try:
        layout = VocabLayout.from_dict(json.loads(folder.read_bytes(rel)))
        return np.asarray(layout.modality_ranges(), np.int64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"{folder.child(rel)}: {e}; token ids not checked against the vocabulary")
        return None


def _check_tokenizers(folder: Folder, m: dict, tmp: Path) -> list[str]:
    """The tokenizers/ folder must be, byte for byte, the one the shards were made with: training
    reads their ids through it and a release copies it (a replaced tokenizer.json, a visual
    tokenizer cut or deleted would train or release ids that mean other things)."""
    from data.names import LAYOUT_FILE, TOKENIZER_FILE, VISUAL_CONFIG_FILE, VISUAL_WEIGHTS_FILE
    from data.names import VISUAL_TOKENIZER_DIR as VISUAL
    from data.tokenize.vtok_files import folder_fingerprints, tokenizer_key, tokenizers_differ

    recorded = m.get("tokenizers") or {}
    if not all(recorded.get(part, "") != "" for part in ("text", "layout")):
        return [
            f"{folder.child(MANIFEST_FILE)}: no tokenizers fingerprints to check tokenizers/ by"
        ]
    rel = recorded.get("folder", "tokenizers")
    local = Path(folder.child(rel))
    if folder.remote:  # the few files the fingerprints read, fetched beside the shards'
        local = Path(tmp) / rel
        for name in (
            TOKENIZER_FILE,
            LAYOUT_FILE,
            *(f"{VISUAL}/{f}" for f in (VISUAL_CONFIG_FILE, VISUAL_WEIGHTS_FILE)),
        ):
            if folder.exists(f"{rel}/{name}"):
                folder.download(f"{rel}/{name}", local / name)
    try:
        have = folder_fingerprints(local)
    except (OSError, ValueError) as e:
        said = str(e).removeprefix("data.tokenizers: ")  # it names the file or the folder
        return [said.replace(str(local), folder.child(rel))]  # a remote one by its URL
    if recorded.get("visual") and have["visual"] is None:
        return [
            f"{folder.child(rel)}: no {VISUAL}/; the shards' image and video ids were made with "
            "one and cannot be read back without it"
        ]
    if differ := tokenizers_differ(tokenizer_key(recorded), have):
        return [
            f"{folder.child(rel)}: not the tokenizers the shards were made with ({differ}: "
            "changed since tokenize wrote them)"
        ]
    return []


def _check_raw(tar: Path, e: dict, read) -> str | None:
    try:
        doc = json.loads(read("json"))
    except ValueError as err:
        return f"{e['key']}.json is not valid JSON ({err})"
    why = validate_doc(doc, set(e["members"]))
    return f"{e['key']}: {why}" if why else None


def _check_tokens(tar: Path, e: dict, read, ranges: np.ndarray | None) -> str | None:
    from data.loader.sample_check import check_ids
    from data.shards.npy import read_npy

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
    # What the loader packs by (blocks kept whole, M-RoPE grids) and counts, from the index alone
    if e.get("blocks") != visual_blocks(spans):
        return f"{e['key']}: the index's visual blocks {e.get('blocks')} are not its spans'"
    counted = np.bincount(mod.astype(np.int64), minlength=len(MODALITY_NAMES)).tolist()
    if e.get("tokens_by_modality") != dict(zip(MODALITY_NAMES, counted, strict=True)):
        return f"{e['key']}: the index's tokens by modality are not its modalities'"
    return None


def _check_summary(idx: Path, shard: dict, index: list[dict]) -> list[str]:
    """The manifest's summary of a token shard, which training reads instead of the index (each
    modality's tokens; the visual blocks and the longest, by which a run too short for them is
    refused at start), must be the index's."""
    tokens = {name: sum(e["tokens_by_modality"][name] for e in index) for name in MODALITY_NAMES}
    blocks = shard_block_stats(e.get("blocks") or [] for e in index)
    said_tokens, said_blocks = shard.get("tokens") or {}, shard.get("blocks") or {}
    # a shard whose every document was rejected records none of them: zeros
    differ = [
        f"{count} {name} tokens, the manifest says {said_tokens.get(name, 0)}"
        for name, count in tokens.items()
        if said_tokens.get(name, 0) != count
    ]
    for media, got in blocks.items():
        said = said_blocks.get(media) or {}
        for key, value in got.items():
            recorded = said.get(key, {} if key == "grids" else 0)
            if recorded != value:
                differ.append(f"{media} blocks' {key} {value}, the manifest says {recorded}")
    return [f"{idx}: {'; '.join(differ)}"] if differ else []


def _check_binary_index(folder: Folder, shard: dict, idx: Path) -> list[str]:
    """The loader's binary index beside a token shard must be there and be exactly the one its
    JSONL index gives (the loader refuses a shard without it, or with a stale one)."""
    from data.shards import token_index

    rel = str(token_index.index_path_for(Path(shard["path"])))
    if not folder.exists(rel):
        return [f"{folder.child(rel)}: missing (the loader reads each shard through it)"]
    try:
        want = token_index.build(idx.read_bytes(), where=folder.child(shard["index"]))
    except ValueError as e:
        return [str(e)]
    if folder.read_bytes(rel) != want:
        return [
            f"{folder.child(rel)}: not the binary index of {idx.name} (tokenize the raw shards "
            "again)"
        ]
    return []


KEYS = ("path", "index")  # a manifest's shard entry: the tar, its index


def verify(out: str | Path, *, progress: bool = False) -> dict:
    folder = Folder(out)
    manifest = load_manifest(out, formats=(MANIFEST_FORMAT, TOKEN_FORMAT))
    tokens = manifest["format"] == TOKEN_FORMAT
    problems: list[str] = []
    ranges = _token_ranges(folder, manifest, problems) if tokens else None
    samples = 0
    with PrivateTemp("verify") as tmp:
        if tokens:
            problems += _check_tokenizers(folder, manifest, Path(tmp))
        for shard in tqdm(manifest["shards"], desc="verify", unit=" shards", disable=not progress):
            try:
                tar, idx = (folder.download(shard[key], Path(tmp) / shard[key]) for key in KEYS)
            except FileNotFoundError:
                problems += [
                    f"{folder.child(shard[key])}: missing"
                    for key in KEYS
                    if not folder.exists(shard[key])
                ]
                continue
            named = _Names(folder, {tar: shard["path"], idx: shard["index"]})
            found, counted = _check_shard(folder, shard, tar, idx, tokens, ranges)
            problems += [named.text(problem) for problem in found]
            samples += counted
            if folder.remote:  # one shard on disk at a time
                shutil.rmtree(tmp, ignore_errors=True)
                Path(tmp).mkdir(exist_ok=True)
    n_rej = 0
    if folder.exists(REJECTS_FILE):
        n_rej = len(folder.read_bytes(REJECTS_FILE).splitlines())
    if n_rej != manifest["totals"]["rejects"]:
        problems.append(
            f"{folder.child(REJECTS_FILE)}: {n_rej} lines, the manifest counts "
            f"{manifest['totals']['rejects']}"
        )
    return {
        "folder": str(folder),
        "format": manifest["format"],
        "shards": len(manifest["shards"]),
        "samples": samples,
        "problems": problems,
        "ok": not problems,
    }


class _Names:
    """A downloaded shard's files named by their URLs in problems (local files: themselves)."""

    def __init__(self, folder: Folder, rels: dict[Path, str]) -> None:
        self.urls = {str(path): folder.child(rel) for path, rel in rels.items()}
        self.remote = folder.remote

    def __call__(self, path: Path) -> str:
        return self.urls[str(path)] if self.remote else str(path)

    def text(self, problem: str) -> str:
        if self.remote:
            for path, url in self.urls.items():
                problem = problem.replace(path, url)
        return problem


def _check_shard(
    folder: Folder, shard: dict, tar: Path, idx: Path, tokens: bool, ranges
) -> tuple[list[str], int]:
    """(problems, samples checked) of one shard whose tar and index are local files."""
    problems: list[str] = []
    if file_sha256(tar) != shard["sha256"]:
        problems.append(f"{tar}: SHA-256 differs from the manifest")
    if file_sha256(idx) != shard["index_sha256"]:
        problems.append(f"{idx}: SHA-256 differs from the manifest")
    try:
        index = read_index(idx)
    except ValueError as e:
        return [*problems, str(e)], 0
    if tokens:
        problems += _check_binary_index(folder, shard, idx)
        try:
            problems += _check_summary(idx, shard, index)
        except (KeyError, TypeError) as e:  # a sample's record lacks the counts
            problems.append(f"{idx}: a sample has no token counts ({e})")
    if len(index) != shard["samples"]:
        problems.append(f"{idx}: {len(index)} samples, the manifest says {shard['samples']}")
    found = check_index(tar, index)
    problems.extend(found)
    if any(not problem.endswith("does not match its hash") for problem in found):
        return problems, 0  # the tar does not match its index: its samples cannot be found
    samples = 0
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
    return problems, samples


def format_verify(r: dict) -> str:
    head = f"{r['folder']}: {r['shards']} shards, {r['samples']} samples checked"
    if r["ok"]:
        return head + ": OK"
    return (
        head
        + f": {len(r['problems'])} problem(s)\n"
        + "\n".join("  " + problem for problem in r["problems"])
    )
