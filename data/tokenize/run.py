"""Tokenize a raw shard folder into a token shard folder.

Layout (docs/formats.md, "Token shards"):
  TOKEN_DIR/<source>/shard-NNNNNN.tar    KEY.ids.npy (int32), KEY.mod.npy (uint8), KEY.json (spans)
  TOKEN_DIR/<source>/shard-NNNNNN.idx.jsonl, TOKEN_DIR/manifest.json, TOKEN_DIR/rejects.jsonl
  TOKEN_DIR/tokenizers/                  the tokenizers used (text BPE, layout, visual tokenizer)

Design choices:
- One token shard per raw shard, same names: the unit of work, parallelism and resumption
  (a shard is done when its record in ``TOKEN_DIR/.tokenize/`` matches the fingerprint).
- The fingerprint covers the raw folder (its plan and shard hashes), both tokenizers, the
  layout and the options; a folder made with any other of them is refused, never mixed.
- ``.npy`` written with ``allow_pickle=False``; nothing here can execute code on load.
- The visual tokenizer runs on a GPU when there is one (``--device``), in batches of images.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from data.parallel import run_jobs
from data.schema import Reject, Sample
from data.shards.manifest import (
    load_manifest,
    load_records,
    record_path,
    versions,
    write_json_atomic,
)
from data.shards.reader import ShardReader
from data.shards.writer import ShardWriter
from data.text_tokenizer import LAYOUT_FILE, TOKENIZER_FILE, TextTokenizer
from data.tokenize.blocks import block_summary
from data.tokenize.encoder import DocEncoder, TokenizeOptions, tokens_by_modality
from data.tokenize.visual import load_visual_tokenizer, weights_fingerprint
from data.vocab import MODALITY_NAMES

FORMAT = "earlyfuse-token-shards"
STATE_DIR = ".tokenize"
CHUNK_DOCS = 64
_ENCODERS: dict = {}


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
    device: str
    threads: int


def batched(it, n: int):
    chunk = []
    for x in it:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def visual_blocks(spans: list[dict]) -> list[list[int]]:
    """[start, end, t, h, w] of each image/video block (t = 0 for an image): what a packer needs
    to keep blocks whole, and M-RoPE positions, from the index alone."""
    out = []
    for sp in spans:
        if sp["type"] == "image":
            out.append([sp["start"], sp["end"], 0, *sp["grid"]])
        elif sp["type"] == "video":
            out.append([sp["start"], sp["end"], *sp["grid"]])
    return out


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _encoder(job: TokenizeJob) -> DocEncoder:
    key = (job.tok_dir, job.vtok_dir, job.opts, job.device)
    if key not in _ENCODERS:
        if job.threads:
            torch.set_num_threads(job.threads)
        text = TextTokenizer.load(job.tok_dir)
        vtok = load_visual_tokenizer(job.vtok_dir, text.layout, job.device)
        _ENCODERS[key] = DocEncoder(text, vtok, job.opts, torch.device(job.device))
    return _ENCODERS[key]


def tokenize_shard(job: TokenizeJob) -> dict:
    enc = _encoder(job)
    raw, out = Path(job.raw_dir), Path(job.out)
    tar_rel = job.shard["path"]
    idx_rel = job.shard["index"]
    writer = ShardWriter(out / tar_rel, out / idx_rel)
    rejects: list[dict] = []
    tokens: Counter = Counter()
    docs = 0
    try:
        with ShardReader(raw / tar_rel, raw / idx_rel) as stream:
            for chunk in batched(stream, CHUNK_DOCS):
                for got in enc.encode_chunk(chunk):
                    if isinstance(got, Reject):
                        rejects.append(got.to_dict())
                        continue
                    meta = {"source": got.source, "spans": got.spans, "tokens": int(len(got.ids))}
                    by_mod = tokens_by_modality(got)
                    writer.write(
                        Sample(
                            got.key,
                            meta,
                            [("ids.npy", npy_bytes(got.ids)), ("mod.npy", npy_bytes(got.modality))],
                        ),
                        {
                            "tokens": int(len(got.ids)),
                            "tokens_by_modality": by_mod,
                            "blocks": visual_blocks(got.spans),
                        },
                    )
                    tokens.update(by_mod)
                    docs += 1
        result = writer.close()
    except BaseException:
        writer.abort()
        raise
    record = {
        "fingerprint": job.fingerprint,
        "index": job.index,
        "num_shards": job.num_shards,
        "source": job.shard["source"],
        "tar": tar_rel,
        "index_file": idx_rel,
        "samples": docs,
        "bytes": result.bytes,
        "sha256": result.sha256,
        "index_sha256": result.index_sha256,
        "tokens": dict(tokens),
        "rejects": rejects,
    }
    write_json_atomic(record_path(out, job.index, STATE_DIR), record)
    return record


def fingerprint_of(raw_manifest: dict, tok_dir: Path, vtok_dir: Path, opts: TokenizeOptions) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "raw_plan": raw_manifest["plan"]["fingerprint"],
                "raw_shards": [s["sha256"] for s in raw_manifest["shards"]],
                "opts": opts.record(),
            },
            sort_keys=True,
        ).encode()
    )
    h.update((tok_dir / TOKENIZER_FILE).read_bytes())
    h.update((tok_dir / LAYOUT_FILE).read_bytes())
    h.update(weights_fingerprint(vtok_dir).encode())
    return h.hexdigest()[:24]


def _done(out: Path, rec: dict | None, fp: str) -> bool:
    return (
        bool(rec)
        and rec["fingerprint"] == fp
        and (out / rec["tar"]).is_file()
        and (out / rec["tar"]).stat().st_size == rec["bytes"]
    )


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
) -> dict:
    raw_dir, out, tok_dir, vtok_dir = Path(raw_dir), Path(out), Path(tok_dir), Path(vtok_dir)
    opts = opts or TokenizeOptions()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    raw_m = load_manifest(raw_dir)
    text = TextTokenizer.load(tok_dir)  # fail early, with the file named, on a bad tokenizer folder
    load_visual_tokenizer(vtok_dir, text.layout)
    fp = fingerprint_of(raw_m, tok_dir, vtok_dir, opts)
    old = out / "manifest.json"
    if old.is_file() and json.loads(old.read_text()).get("fingerprint") != fp:
        raise ValueError(
            f"{out} holds token shards of other inputs, tokenizers or options; "
            "choose a new --out or delete that folder"
        )
    records = load_records(out, STATE_DIR)
    if any(r["fingerprint"] != fp for r in records.values()):
        raise ValueError(
            f"{out}/{STATE_DIR} holds shards of another tokenization; choose a new --out or delete it"
        )
    n = len(raw_m["shards"])
    jobs = [
        TokenizeJob(
            str(raw_dir),
            str(out),
            s,
            i,
            n,
            str(tok_dir),
            str(vtok_dir),
            opts,
            fp,
            device,
            1 if workers > 1 else 0,
        )
        for i, s in enumerate(raw_m["shards"])
        if not _done(out, records.get(i), fp)
    ]
    bar = tqdm(
        total=n, initial=n - len(jobs), desc="tokenize", unit=" shards", disable=not progress
    )
    for rec in run_jobs(tokenize_shard, jobs, workers):
        records[rec["index"]] = rec
        bar.update()
    bar.close()
    return finalize_tokens(out, raw_dir, raw_m, records, tok_dir, vtok_dir, opts, fp, text)


def finalize_tokens(
    out: Path,
    raw_dir: Path,
    raw_m: dict,
    records: dict,
    tok_dir: Path,
    vtok_dir: Path,
    opts: TokenizeOptions,
    fp: str,
    text: TextTokenizer,
) -> dict:
    recs = [records[i] for i in sorted(records)]
    tdir = out / "tokenizers"
    tdir.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, LAYOUT_FILE):
        shutil.copyfile(tok_dir / name, tdir / name)
    shutil.copytree(vtok_dir, tdir / "visual_tokenizer", dirs_exist_ok=True)
    totals: Counter = Counter()
    rejects = []
    sources: dict[str, dict] = {}
    for r in recs:
        totals.update(r["tokens"])
        rejects.extend(r["rejects"])
        s = sources.setdefault(
            r["source"], {"name": r["source"], "samples": 0, "tokens": Counter(), "shards": 0}
        )
        s["samples"] += r["samples"]
        s["tokens"].update(r["tokens"])
        s["shards"] += 1
    blocks = block_summary(out, recs)
    for s in sources.values():
        s["tokens"] = {m: s["tokens"].get(m, 0) for m in MODALITY_NAMES}
        s["blocks"] = blocks[s["name"]]
    manifest = {
        "format": FORMAT,
        "version": 1,
        "fingerprint": fp,
        "inputs": {"raw": str(raw_dir.resolve()), "raw_plan": raw_m["plan"]["fingerprint"]},
        "tokenizers": {
            "text": text.fingerprint(),
            "layout": text.layout.fingerprint(),
            "visual": weights_fingerprint(vtok_dir),
            "folder": "tokenizers",
        },
        "options": asdict(opts),
        "sources": list(sources.values()),
        "shards": [
            {
                "path": r["tar"],
                "index": r["index_file"],
                "source": r["source"],
                "samples": r["samples"],
                "bytes": r["bytes"],
                "sha256": r["sha256"],
                "index_sha256": r["index_sha256"],
                "tokens": r["tokens"],
            }
            for r in recs
        ],
        "totals": {
            "samples": sum(r["samples"] for r in recs),
            "bytes": sum(r["bytes"] for r in recs),
            "tokens": sum(totals.values()),
            "tokens_by_modality": {m: totals.get(m, 0) for m in MODALITY_NAMES},
            "rejects": len(rejects),
            "rejects_by_reason": dict(Counter(r["reason"] for r in rejects)),
        },
        "created_by": {"versions": versions()},
    }
    write_json_atomic(out / "rejects.jsonl", None, lines=rejects)
    write_json_atomic(out / "manifest.json", manifest)
    return manifest
