"""Tokenize a raw shard folder into a token shard folder.

Layout (docs/formats.md, "Token shards"):
  TOKEN_DIR/<source>/shard-NNNNNN.tar    KEY.ids.npy (int32), KEY.mod.npy (uint8), KEY.json (spans)
  TOKEN_DIR/<source>/shard-NNNNNN.idx.jsonl, .idx.bin (the loader's binary index, from the JSONL)
  TOKEN_DIR/manifest.json, TOKEN_DIR/rejects.jsonl
  TOKEN_DIR/tokenizers/                  the tokenizers used (text BPE, layout, visual tokenizer)

Design choices:
- One token shard per raw shard, same names: the unit of work, parallelism and resumption
  (a shard is done when its record in ``TOKEN_DIR/.tokenize/`` matches the fingerprint).
- The fingerprint covers the raw folder (its plan and shard hashes), both tokenizers, the
  layout and the options; a folder made with any other of them is refused, never mixed.
- ``.npy`` written with ``allow_pickle=False``; nothing here can execute code on load.
- The visual tokenizer runs on a GPU when there is one (``--device``), in batches of images.
- Workers are long-lived (``data.engine``): each loads the BPE once, and the visual
  tokenizer once, on the first chunk that holds an image or a video. A chunk of text and
  code only is encoded without torch (``data.tokenize.docs``), so a text corpus never
  imports it. The parent checks the visual tokenizer's files without building the model.
- Partitionable like ingest (``--num-partitions/--partition``): partition I takes the
  shards whose index is I mod P; the last one to finish (or ``earlyfuse-prep merge``)
  writes the manifest. Every partitioning and engine gives the same bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.engine import EngineConfig, run_jobs
from data.names import (
    INDEX_SUFFIX,
    LAYOUT_FILE,
    MANIFEST_FILE,
    REJECTS_FILE,
    TOKENIZER_FILE,
    TOKENIZERS_DIR,
    VISUAL_TOKENIZER_DIR,
)
from data.schema import Reject, Sample
from data.shards import token_index
from data.shards.manifest import (
    MANIFEST_FORMAT,
    load_manifest,
    record_path,
    shard_entry,
    versions,
    write_json_atomic,
)
from data.shards.reader import ShardReader
from data.shards.storage import Folder, Staging
from data.shards.writer import ShardWriter
from data.text_tokenizer import TextTokenizer
from data.tokenize.blocks import block_summary, shard_block_stats, visual_blocks
from data.tokenize.docs import TokenizeOptions, encode_text_chunk, has_visual, tokens_by_modality
from data.tokenize.vtok_files import check_visual_tokenizer, weights_fingerprint
from data.vocab import MODALITY_NAMES

FORMAT = "earlyfuse-token-shards"
STATE_DIR = ".tokenize"
CHUNK_DOCS = 64
_CACHE: dict = {}  # per worker process: the BPE and the visual encoder, built once each


@dataclass
class TokenizeJob:
    raw_dir: str
    out: str
    shard: dict  # the raw manifest's entry
    index: int
    num_shards: int
    tok_dir: str
    vtok_dir: str
    opts: TokenizeOptions
    fingerprint: str
    device: str | None  # None: cuda if the worker has it, else cpu
    threads: int  # CPU threads of the worker's BPE and torch (0: leave the defaults)
    vtok_actors: list | None = None  # ray: GPU actors holding the visual tokenizer


def batched(it, n: int):
    chunk = []
    for item in it:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _text_tokenizer(job: TokenizeJob) -> TextTokenizer:
    key = ("text", job.tok_dir)
    if key not in _CACHE:
        if job.threads and "RAYON_NUM_THREADS" not in os.environ:
            # Set before the BPE's first parallel call builds its thread pool: N workers on
            # N cores must not each start N threads.
            os.environ["RAYON_NUM_THREADS"] = str(job.threads)
        _CACHE[key] = TextTokenizer.load(job.tok_dir)
    return _CACHE[key]


def _visual_encoder(job: TokenizeJob):
    """The worker's DocEncoder, built on the first chunk with an image or a video: only then
    are torch and the visual tokenizer loaded (once per worker)."""
    # The GPU actors themselves belong to the key: the Ray engine replaces one that died, and a
    # worker must then call the new one, not keep an encoder bound to the dead one.
    key = ("visual", job.tok_dir, job.vtok_dir, job.opts, job.device, tuple(job.vtok_actors or ()))
    if key not in _CACHE:
        import torch

        from data.tokenize.encoder import DocEncoder

        if job.threads:
            torch.set_num_threads(job.threads)
        text = _text_tokenizer(job)
        if job.vtok_actors:
            from data.tokenize.remote_visual import RemoteVisualTokenizer

            vtok, device = RemoteVisualTokenizer(job.vtok_actors, job.vtok_dir), "cpu"
        else:
            from data.tokenize.visual import load_visual_tokenizer

            device = job.device or ("cuda" if torch.cuda.is_available() else "cpu")
            vtok = load_visual_tokenizer(job.vtok_dir, text.layout, device)
        _CACHE[key] = DocEncoder(text, vtok, job.opts, torch.device(device))
    return _CACHE[key]


def encode_chunk(job: TokenizeJob, chunk: list) -> list:
    if has_visual(chunk):
        return _visual_encoder(job).encode_chunk(chunk)
    return encode_text_chunk(_text_tokenizer(job), chunk)


def tokenize_shard(job: TokenizeJob) -> dict:
    raw, dest = Folder(job.raw_dir), Folder(job.out)
    tar_rel = job.shard["path"]
    idx_rel = job.shard["index"]
    with Staging(dest) as stage:
        # A raw shard in object storage is downloaded whole first (every member is read).
        inputs = stage.path(".inputs") if raw.remote else Path()
        tar = raw.download(tar_rel, inputs / tar_rel)
        idx = raw.download(idx_rel, inputs / idx_rel)
        record = _tokenize_shard(job, tar, idx, stage)
        stage.publish([idx_rel, record["index_bin"], tar_rel])
    dest.write_json(record_path(Path(""), job.index, STATE_DIR).as_posix(), record)
    return record


def _tokenize_shard(job: TokenizeJob, raw_tar: Path, raw_idx: Path, stage: Staging) -> dict:
    tar_rel = job.shard["path"]
    idx_rel = job.shard["index"]
    writer = ShardWriter(stage.path(tar_rel), stage.path(idx_rel))
    rejects: list[dict] = []
    tokens: Counter = Counter()
    docs = 0
    doc_blocks: list[list[list[int]]] = []
    try:
        with ShardReader(raw_tar, raw_idx) as stream:
            for chunk in batched(stream, CHUNK_DOCS):
                for got in encode_chunk(job, chunk):
                    if isinstance(got, Reject):
                        rejects.append(got.to_dict())
                        continue
                    meta = {"source": got.source, "spans": got.spans, "tokens": int(len(got.ids))}
                    by_mod = tokens_by_modality(got)
                    doc_blocks.append(visual_blocks(got.spans))
                    writer.write(
                        Sample(
                            got.key,
                            meta,
                            [("ids.npy", npy_bytes(got.ids)), ("mod.npy", npy_bytes(got.modality))],
                        ),
                        {
                            "tokens": int(len(got.ids)),
                            "tokens_by_modality": by_mod,
                            "blocks": doc_blocks[-1],
                        },
                    )
                    tokens.update(by_mod)
                    docs += 1
        result = writer.close()
    except BaseException:
        writer.abort()
        raise
    # The loader's binary index (data/shards/token_index.py), derived from the JSONL just written.
    bin_rel = binary_index_name(idx_rel)
    token_index.write(stage.path(bin_rel), token_index.build(stage.path(idx_rel).read_bytes()))
    return {
        "fingerprint": job.fingerprint,
        "index": job.index,
        "num_shards": job.num_shards,
        "source": job.shard["source"],
        "tar": tar_rel,
        "index_file": idx_rel,
        "index_bin": bin_rel,
        "samples": docs,
        "bytes": result.bytes,
        "sha256": result.sha256,
        "index_sha256": result.index_sha256,
        "tokens": dict(tokens),
        "block_stats": shard_block_stats(doc_blocks),
        "rejects": rejects,
        # What `earlyfuse-prep merge` needs to finish a partitioned run's manifest.
        "inputs": {"raw": job.raw_dir, "tokenizer": job.tok_dir, "visual": job.vtok_dir},
        "options": asdict(job.opts),
    }


def binary_index_name(idx_rel: str) -> str:
    """``code/shard-000000.idx.jsonl`` -> ``code/shard-000000.idx.bin``."""
    stem = idx_rel[: -len(INDEX_SUFFIX)] if idx_rel.endswith(INDEX_SUFFIX) else idx_rel
    return stem + token_index.SUFFIX


def fingerprint_of(raw_manifest: dict, tok_dir: Path, vtok_dir: Path, opts: TokenizeOptions) -> str:
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            {
                "raw_plan": raw_manifest["plan"]["fingerprint"],
                "raw_shards": [shard["sha256"] for shard in raw_manifest["shards"]],
                "opts": opts.record(),
            },
            sort_keys=True,
        ).encode()
    )
    digest.update((tok_dir / TOKENIZER_FILE).read_bytes())
    digest.update((tok_dir / LAYOUT_FILE).read_bytes())
    digest.update(weights_fingerprint(vtok_dir).encode())
    return digest.hexdigest()[:24]


def _done(sizes: dict[str, int], rec: dict | None, fp: str) -> bool:
    """The shard's record matches and its tar is there (``sizes``: one listing of the folder)."""
    if not rec:
        return False
    return rec["fingerprint"] == fp and sizes.get(rec["tar"]) == rec["bytes"]


def read_raw_manifest(raw: Folder) -> dict:
    if not raw.remote:
        return load_manifest(raw.local)
    try:
        manifest = raw.read_json(MANIFEST_FILE)
    except FileNotFoundError:
        raise ValueError(
            f"{raw.child(MANIFEST_FILE)}: no manifest (not an ingest output)"
        ) from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(
            f"{raw.child(MANIFEST_FILE)}: format {manifest.get('format')!r}, "
            f"expected {MANIFEST_FORMAT!r}"
        )
    return manifest


def tokenize(
    raw_dir: str | Path,
    out: str | Path,
    tok_dir: str | Path,
    vtok_dir: str | Path,
    *,
    opts: TokenizeOptions | None = None,
    workers: int = 1,
    device: str | None = None,
    progress: bool = False,
    num_partitions: int = 1,
    partition: int = 0,
    engine: EngineConfig | None = None,
) -> dict:
    """Tokenize this partition's missing shards; when every shard of the folder is done, write
    the manifest (then returned, with ``"finalized": True``). Otherwise returns a summary of
    what this run did and which shards other partitions still owe (``"missing"``)."""
    if not (num_partitions >= 1 and 0 <= partition < num_partitions):
        raise ValueError(f"--partition {partition} is outside 0..{num_partitions - 1}")
    raw, dest = Folder(raw_dir), Folder(out)
    tok_dir, vtok_dir = Path(tok_dir), Path(vtok_dir)
    opts = opts or TokenizeOptions()
    engine = engine or EngineConfig(workers=workers)
    raw_m = read_raw_manifest(raw)
    text = TextTokenizer.load(tok_dir)  # fail early, with the file named, on a bad tokenizer folder
    check_visual_tokenizer(vtok_dir, text.layout)
    fingerprint = fingerprint_of(raw_m, tok_dir, vtok_dir, opts)
    if (
        dest.exists(MANIFEST_FILE)
        and dest.read_json(MANIFEST_FILE).get("fingerprint") != fingerprint
    ):
        raise ValueError(
            f"{out} holds token shards of other inputs, tokenizers or options; "
            "choose a new --out or delete that folder"
        )
    records = dest.records(STATE_DIR)
    if any(record["fingerprint"] != fingerprint for record in records.values()):
        raise ValueError(
            f"{out}/{STATE_DIR} holds shards of another tokenization; choose a new --out or delete it"
        )
    num_shards = len(raw_m["shards"])
    mine = [
        shard_index
        for shard_index in range(num_shards)
        if shard_index % num_partitions == partition
    ]
    sizes = dest.sizes()
    # N local workers on N cores: one BPE/torch thread each (0: the libraries' defaults).
    threads = 1 if engine.kind == "ray" or engine.workers > 1 else 0
    jobs = [
        TokenizeJob(  # absolute paths: a Ray actor runs in another folder, maybe on another node
            raw.absolute(),
            dest.absolute(),
            raw_m["shards"][shard_index],
            shard_index,
            num_shards,
            str(tok_dir.resolve()),
            str(vtok_dir.resolve()),
            opts,
            fingerprint,
            device,
            threads,
        )
        for shard_index in mine
        if not _done(sizes, records.get(shard_index), fingerprint)
    ]
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(jobs),
        desc="tokenize",
        unit=" shards",
        disable=not progress,
    )
    gpu_setup = None
    if device is None or device.startswith("cuda"):
        from data.tokenize.remote_visual import gpu_setup_for

        gpu_setup = gpu_setup_for(str(vtok_dir.resolve()), str(tok_dir.resolve()))
    for rec in run_jobs(tokenize_shard, jobs, engine, gpu_setup=gpu_setup):
        records[rec["index"]] = rec
        bar.update()
    bar.close()
    records.update(dest.records(STATE_DIR))  # what other partitions finished meanwhile
    sizes = dest.sizes()
    missing = [
        shard_index
        for shard_index in range(num_shards)
        if not _done(sizes, records.get(shard_index), fingerprint)
    ]
    if missing:
        return {
            "finalized": False,
            "written": len(jobs),
            "skipped_done": len(mine) - len(jobs),
            "partition": [partition, num_partitions],
            "missing": missing,
        }
    manifest = finalize_tokens(
        dest, raw, raw_m, records, tok_dir, vtok_dir, opts, fingerprint, text
    )
    return {**manifest, "finalized": True, "written": len(jobs)}


def finalize_tokens(
    dest: Folder,
    raw: Folder,
    raw_m: dict,
    records: dict,
    tok_dir: Path,
    vtok_dir: Path,
    opts: TokenizeOptions,
    fp: str,
    text: TextTokenizer,
) -> dict:
    """manifest.json, rejects.jsonl and the tokenizers' copy: in place, or staged and uploaded."""
    with Staging(dest) as stage:
        manifest = _finalize_tokens(stage, raw, raw_m, records, tok_dir, vtok_dir, opts, fp, text)
        copied = sorted(
            str(path.relative_to(stage.path(""))) for path in stage.path(TOKENIZERS_DIR).rglob("*")
        )
        stage.publish([rel_path for rel_path in copied if stage.path(rel_path).is_file()])
        stage.publish([REJECTS_FILE, MANIFEST_FILE])  # the manifest last: the folder is done
    return manifest


def _finalize_tokens(
    stage: Staging,
    raw: Folder,
    raw_m: dict,
    records: dict,
    tok_dir: Path,
    vtok_dir: Path,
    opts: TokenizeOptions,
    fp: str,
    text: TextTokenizer,
) -> dict:
    recs = [records[i] for i in sorted(records)]
    tdir = stage.path(TOKENIZERS_DIR)
    tdir.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, LAYOUT_FILE):
        shutil.copyfile(tok_dir / name, tdir / name)
    shutil.copytree(vtok_dir, tdir / VISUAL_TOKENIZER_DIR, dirs_exist_ok=True)
    totals: Counter = Counter()
    rejects = []
    sources: dict[str, dict] = {}
    for record in recs:
        totals.update(record["tokens"])
        rejects.extend(record["rejects"])
        source = sources.setdefault(
            record["source"],
            {"name": record["source"], "samples": 0, "tokens": Counter(), "shards": 0},
        )
        source["samples"] += record["samples"]
        source["tokens"].update(record["tokens"])
        source["shards"] += 1

    def read_index_of(rec: dict) -> list[dict]:  # records written before block_stats existed
        text = stage.dest.read_bytes(rec["index_file"]).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    blocks = block_summary(recs, read_index_of)
    for source in sources.values():
        source["tokens"] = {
            modality: source["tokens"].get(modality, 0) for modality in MODALITY_NAMES
        }
        source["blocks"] = blocks[source["name"]]
    manifest = {
        "format": FORMAT,
        "version": 1,
        "fingerprint": fp,
        "inputs": {
            "raw": raw.url if raw.remote else str(raw.local.resolve()),
            "raw_plan": raw_m["plan"]["fingerprint"],
        },
        "tokenizers": {
            "text": text.fingerprint(),
            "layout": text.layout.fingerprint(),
            "visual": weights_fingerprint(vtok_dir),
            "folder": TOKENIZERS_DIR,
        },
        "options": asdict(opts),
        "sources": list(sources.values()),
        "shards": [
            shard_entry(
                record,
                tokens=record["tokens"],
                # What the loader's start needs of a shard, so that it reads no index then.
                **({"index_bin": record["index_bin"]} if "index_bin" in record else {}),
                **({"blocks": record["block_stats"]} if "block_stats" in record else {}),
            )
            for record in recs
        ],
        "totals": {
            "samples": sum(record["samples"] for record in recs),
            "bytes": sum(record["bytes"] for record in recs),
            "tokens": sum(totals.values()),
            "tokens_by_modality": {
                modality: totals.get(modality, 0) for modality in MODALITY_NAMES
            },
            "rejects": len(rejects),
            "rejects_by_reason": dict(Counter(record["reason"] for record in rejects)),
        },
        "created_by": {"versions": versions()},
    }
    write_json_atomic(stage.path(REJECTS_FILE), None, lines=rejects)
    write_json_atomic(stage.path(MANIFEST_FILE), manifest)
    return manifest


def merge_tokens(out: str | Path) -> dict:
    """Finish a token folder whose partitions all ran (``earlyfuse-prep merge TOKEN_DIR``)."""
    dest = Folder(out)
    records = dest.records(STATE_DIR)
    if not records:
        raise ValueError(f"{out}: no tokenize records in {out}/{STATE_DIR}")
    prints = {record["fingerprint"] for record in records.values()}
    if len(prints) > 1:
        raise ValueError(
            f"{out}: records of {len(prints)} different tokenizations; partitions must be run "
            "with identical inputs, tokenizers and options"
        )
    first = next(iter(records.values()))
    if "inputs" not in first:
        raise ValueError(f"{out}: records written before partitioned tokenize; rerun tokenize")
    raw = Folder(first["inputs"]["raw"])
    tok_dir, vtok_dir = Path(first["inputs"]["tokenizer"]), Path(first["inputs"]["visual"])
    fingerprint = first["fingerprint"]
    sizes = dest.sizes()
    missing = [
        shard_index
        for shard_index in range(first["num_shards"])
        if not _done(sizes, records.get(shard_index), fingerprint)
    ]
    if missing:
        raise ValueError(
            f"{out}: {len(missing)} token shard(s) not written yet (e.g. {missing[:5]}); run the "
            "partitions that owe them, then merge again"
        )
    opts = TokenizeOptions(**first["options"])
    text = TextTokenizer.load(tok_dir)
    raw_m = read_raw_manifest(raw)
    if fingerprint_of(raw_m, tok_dir, vtok_dir, opts) != fingerprint:
        raise ValueError(
            f"{out}: the raw folder or tokenizers changed since these shards were made"
        )
    return finalize_tokens(dest, raw, raw_m, records, tok_dir, vtok_dir, opts, fingerprint, text)
