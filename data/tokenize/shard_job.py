"""One tokenize job: a raw shard in, its token shard out, with the record that says it is done.
This is what the workers run (``data.engine.run_jobs``); the driver that plans the jobs,
resumes, partitions and writes the folder's manifest is run.py. Kept apart because it runs in
other processes (maybe on other nodes, under Ray) with its own per-process cache, and it must
stay light: a chunk of text and code only is encoded without importing torch.

Design choices:
- ``.npy`` written with ``allow_pickle=False``; nothing here can execute code on load.
- The visual tokenizer runs on a GPU when there is one (``--device``), in batches of images.
- Workers are long-lived (``data.engine``): each loads the BPE once, and the visual
  tokenizer once, on the first chunk that holds an image or a video. A chunk of text and
  code only is encoded without torch (``data.tokenize.docs``), so a text corpus never
  imports it.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data.image_prep import SWAPS_SIDES
from data.names import INDEX_SUFFIX
from data.schema import Reject, Sample
from data.shards import token_index
from data.shards.index import file_sha256
from data.shards.manifest import record_path
from data.shards.reader import ShardReader
from data.shards.storage import Folder, PrivateTemp, Staging, write_atomic
from data.shards.writer import ShardResult, ShardWriter
from data.text_tokenizer import TextTokenizer
from data.tokenize.blocks import shard_block_stats, visual_blocks
from data.tokenize.docs import (
    TokenDoc,
    TokenizeOptions,
    encode_text_chunk,
    has_visual,
    tokens_by_modality,
)

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
    partition: tuple[int, int] = (0, 1)  # (I, P) of the run that wrote it
    command: tuple[str, ...] = ()  # the command line that ran it


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
    with Staging(dest) as stage, PrivateTemp("inputs") as got:
        # A raw shard in object storage is downloaded whole first (every member is read), into a
        # temp folder gone with the job: never into the output folder, whatever it is.
        inputs = Path(got) if raw.remote else Path()
        tar = raw.download(tar_rel, inputs / tar_rel)
        idx = raw.download(idx_rel, inputs / idx_rel)
        record = _tokenize_shard(job, tar, idx, stage)
        indexes = (idx_rel, record["index_bin"])
        record["index_sizes"] = {rel: stage.path(rel).stat().st_size for rel in indexes}
        stage.publish([*indexes, tar_rel])
    dest.write_json(record_path(job.index, STATE_DIR), record)
    return record


class TokenShardWriter:
    """One token shard as tokenize writes it: each document's ``ids.npy`` and ``mod.npy`` with its
    meta in the tar, its token counts and visual blocks in the JSONL index, and on ``close`` the
    loader's binary index built from that JSONL. The one writer of the format: the tools that
    make token folders of their own (the benchmarks, the instability suite) use it too."""

    def __init__(self, tar: Path, index: Path):
        self.index = Path(index)
        self.writer = ShardWriter(tar, index)
        self.tokens: Counter = Counter()  # tokens by modality name, over the shard
        self.doc_blocks: list[list[list[int]]] = []  # each document's ``visual_blocks``

    def write(self, doc: TokenDoc) -> None:
        by_mod = tokens_by_modality(doc)
        self.doc_blocks.append(visual_blocks(doc.spans))
        meta = {"source": doc.source, "spans": doc.spans, "tokens": int(len(doc.ids))}
        members = [("ids.npy", npy_bytes(doc.ids)), ("mod.npy", npy_bytes(doc.modality))]
        extra = {"tokens": int(len(doc.ids)), "tokens_by_modality": by_mod}
        self.writer.write(Sample(doc.key, meta, members), {**extra, "blocks": self.doc_blocks[-1]})
        self.tokens.update(by_mod)

    def close(self, binary: Path) -> ShardResult:
        """Finish the tar and the JSONL index, and write the binary index to ``binary``."""
        result = self.writer.close()
        write_atomic(binary, token_index.build(self.index.read_bytes()))
        return result

    def abort(self) -> None:
        self.writer.abort()


def _tokenize_shard(job: TokenizeJob, raw_tar: Path, raw_idx: Path, stage: Staging) -> dict:
    tar_rel = job.shard["path"]
    idx_rel = job.shard["index"]
    bin_rel = binary_index_name(idx_rel)
    # an index line gone loses a document, a damaged tar (a bad disk, a copy cut short) changes
    # one: both are refused (hashing a shard costs a fraction of a second, tokenizing it minutes)
    for path, rel, digest in ((raw_idx, idx_rel, "index_sha256"), (raw_tar, tar_rel, "sha256")):
        if file_sha256(path) != job.shard[digest]:
            raise ValueError(
                f"{job.raw_dir}/{rel}: not the {'index' if path is raw_idx else 'shard'} ingest "
                f"wrote (its SHA-256 is not the manifest's): the folder changed after ingest; "
                f"earlyfuse-prep verify {job.raw_dir} says what else"
            )
    writer = TokenShardWriter(stage.path(tar_rel), stage.path(idx_rel))
    rejects: list[dict] = []
    squeezed: list[str] = []  # keys of documents holding an image its grid draws out of shape
    sparse: list[tuple[float, str]] = []  # (widest gap, key) of clips the budget thinned
    try:
        with ShardReader(raw_tar, raw_idx) as stream:
            for chunk in batched(stream, CHUNK_DOCS):
                for raw_doc, got in zip(chunk, encode_chunk(job, chunk), strict=True):
                    if isinstance(got, Reject):
                        rejects.append(got.to_dict())
                    else:
                        writer.write(got)
                        if out_of_shape(raw_doc.doc["segments"], got.spans):
                            squeezed.append(got.key)
                        if (gap := widest_gap(got.spans)) > SPARSE * (1 / job.opts.video_fps):
                            sparse.append((gap, got.key))
        result = writer.close(stage.path(bin_rel))
    except BaseException:
        writer.abort()
        raise
    return {
        "fingerprint": job.fingerprint,
        "index": job.index,
        "num_shards": job.num_shards,
        "source": job.shard["source"],
        "tar": tar_rel,
        "index_file": idx_rel,
        "index_bin": bin_rel,
        "samples": result.samples,
        "bytes": result.bytes,
        "sha256": result.sha256,
        "index_sha256": result.index_sha256,
        "tokens": dict(writer.tokens),
        "block_stats": shard_block_stats(writer.doc_blocks),
        "out_of_shape": {"documents": len(squeezed), "examples": squeezed[:3]},
        "sparse_clips": {
            "clips": len(sparse),
            "widest": max((gap for gap, _ in sparse), default=0.0),
            "examples": [key for _, key in sorted(sparse, reverse=True)[:3]],
        },
        "rejects": rejects,
        "partition": list(job.partition),
        "command": list(job.command),
        # What `earlyfuse-prep merge` needs to finish a partitioned run's manifest.
        "inputs": {"raw": job.raw_dir, "tokenizer": job.tok_dir, "visual": job.vtok_dir},
        "options": asdict(job.opts),
    }


SPARSE = 1.5  # a clip whose kept frames lie this many --video-fps intervals apart is said


def widest_gap(spans: list[dict]) -> float:
    """The widest gap, in seconds, between kept frames of a document's clips (0 without): a
    clip longer than its block budget holds at --video-fps keeps fewer frames over its whole
    length, which tokenize says rather than leave to the JSON spans."""
    gaps = [
        b - a for span in spans for a, b in zip(span.get("times", []), span.get("times", [])[1:])
    ]
    return max(gaps, default=0.0)


def out_of_shape(segments: list[dict], spans: list[dict]) -> bool:
    """Whether an image of the document is drawn more than twice out of shape by its grid: a
    grid holds at most ``max_grid`` tokens a side, so a strip longer than that (a 4000x3 web
    separator) is squeezed to ``max_grid``:1; tokenize says how many, rather than drop them."""
    images = [seg for seg in segments if seg["type"] == "image"]
    grids = [span["grid"] for span in spans if span["type"] == "image"]
    for seg, (rows, cols) in zip(images, grids):
        width, height = seg["width"], seg["height"]
        if seg.get("orientation", 1) in SWAPS_SIDES:
            width, height = height, width
        change = (cols * height) / (rows * width)
        if max(change, 1 / change) > 2:
            return True
    return False


def binary_index_name(idx_rel: str) -> str:
    """``code/shard-000000.idx.jsonl`` -> ``code/shard-000000.idx.bin``."""
    stem = idx_rel[: -len(INDEX_SUFFIX)] if idx_rel.endswith(INDEX_SUFFIX) else idx_rel
    return stem + token_index.SUFFIX
