"""earlyfuse's loader against the loaders of the field: one epoch each, start-up included.

The peers: LitData (``litdata``; per-document arrays and its ``TokensLoader``), MosaicML
Streaming (``mosaicml-streaming``), webdataset and Megatron-Energon (``megatron-energon``).
They are not dependencies of the project: install them into a virtual environment of their own
(docs/benchmarks.md, "The loaders of the field"); a peer whose package is absent is skipped.

**The corpus** (built once, cached under ``--corpus``): real text and code from this machine --
the ``.py`` files (code) and ``.txt``/``.rst``/``.md`` files (text) of the Python standard
library and of the running interpreter's site-packages, or the folders given with
``--material`` --, read in sorted order, cut or joined into documents of about
``--doc-tokens`` tokens (each length drawn between half and one and a half times it), until
``--docs`` documents. Tokenized with a project tokenizer folder (``--tokenizer DIR``: its
``tokenizer.json`` and ``vocab_layout.json``) or, without one, with the byte-level fallback:
one id per UTF-8 byte (id = byte + 3, after the pad/bos/eos specials), every document ended by
eos -- the loader's work depends on the number of tokens and documents, not on which ids they
are. ``--visual TOKEN_DIR`` adds the image, video and interleaved documents of a token folder
made by ``earlyfuse-prep tokenize`` (and tokenizes the text with that folder's tokenizer, so
that one vocabulary covers all). The corpus is written as earlyfuse token shards (tar,
JSONL and binary index, manifest: the project's own writers), then converted, untimed, into each
peer's own format: webdataset tars (``KEY.ids.npy``, ``KEY.mod.npy``), Streaming MDS shards (two
``ndarray`` columns), LitData chunks of per-document arrays, LitData ``TokensLoader`` chunks
(one token stream, id * 8 + modality in an int32, split again after the batch is built) and an
Energon dataset (the webdataset tars prepared by Energon, a ``CrudeWebdataset`` and a cooker).

**The same packing work for every loader**: rows of ``--seq-len`` tokens, ``--rows`` rows a
batch, documents concatenated and cut (``MinimalPacker``: ids and modalities, what a peer's
user writes at least), running where the documents arrive: in the DataLoader worker with one
worker, in the process otherwise. LitData's ``TokensLoader`` cuts the rows itself (that is its
point); its batch is ``--rows`` of them stacked. earlyfuse runs its whole loader: the sources'
token-weighted mix, hashed order, SHA-256 and vocabulary checks, blocks kept whole, labels,
document ids, 1-D and M-RoPE positions, image ids.

**Each peer at its documented fast settings**: Streaming with its default read-ahead
(``predownload`` derived from ``batch_size``, given the rows of a batch); LitData's
``StreamingDataset`` with its default item loader and with ``TokensLoader``; webdataset's own
``.decode()`` (``.npy`` members decoded by its default handlers); Energon's ``get_loader`` with
its own sample decoder, its worker cooking and packing (the task encoder's ``encode_batch`` runs
the packer there).

**One measure is one fresh process** (``--measure``, started by this script): it imports the
library (``import_s``), builds the loader, takes the first batch (``first_batch_s``, from the
loader built), then the rest of one epoch. ``tokens/s`` is the real tokens of the epoch over the
time from the start of building to the last batch (start-up counted; imports are not, they are
printed apart). While it runs, this script samples the RSS and the PSS of the measure's whole
process tree (the process and its workers) every 50 ms and keeps the peaks. Every loader runs
for 20 batches untimed first (page cache, on-disk caches), then ``--rounds`` rounds, the order
rotated each round; medians. Ratios are printed against LitData (per-document arrays: the
strongest fair baseline) and against earlyfuse's previous figures (``--previous FILE``, a JSON
this script saved with ``--save``; by default those of an earlier measurement of the same
design).

    python tools/bench/bench_peers.py --corpus runs/bench-peers [--docs 27000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

PEERS = {
    "litdata": "litdata",
    "litdata-tokens": "litdata",
    "streaming": "streaming",
    "webdataset": "webdataset",
    "energon": "megatron.energon",
}
LOADERS = ["earlyfuse", *PEERS]
BASELINE = "litdata"
CODE_SUFFIXES = (".py",)
TEXT_SUFFIXES = (".txt", ".rst", ".md")
DOCS_PER_SHARD = 1000
BYTE_OFFSET = 3  # the byte-level fallback's ids: after <|pad|>, <|bos|>, <|eos|>
EOS_ID = 2
MOD_BITS = 3  # LitData TokensLoader: id * 8 + modality in one int32
CORPUS_VERSION = 1

# earlyfuse's figures from an earlier measurement of this benchmark's design (27,954 documents of
# Python sources and prose, ~1,840 tokens each, 51.5M tokens; fresh process per measure), ratios
# against LitData's per-document arrays; with one worker it gave no ratio counting start-up.
# ``--previous FILE`` replaces them with a result this script saved.
PREVIOUS = {
    "source": "an earlier measurement (27,954 documents, 51.5M tokens)",
    "workers=0": {"first_batch_s": 3.3, "epoch_vs_litdata": 0.3, "peak_rss_vs_litdata": 2.1},
    "workers=1": {"first_batch_s": 7.8, "peak_rss_vs_litdata": 2.6},
}
# The loader's goals for start-up, memory and speed, printed beside the results.
GOALS = {
    "workers=0": {"first_batch_s": 0.5, "epoch_vs_litdata": 1.2, "peak_rss_vs_litdata": 1.3},
    "workers=1": {"first_batch_s": 1.5, "epoch_vs_litdata": 3.0, "peak_rss_vs_litdata": 1.3},
}


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# --- the corpus ------------------------------------------------------------------------------------
def default_material() -> list[Path]:
    paths = sysconfig.get_paths()
    found = []
    for key in ("stdlib", "purelib", "platlib"):
        path = Path(paths[key])
        if path.is_dir() and path not in found:
            found.append(path)
    return found


def material_files(roots: list[Path]) -> tuple[list[Path], list[Path]]:
    """(code files, text files) under ``roots``, sorted, each file once."""
    code, text, seen = [], [], set()
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"{root}: --material must be a folder")
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for filename in sorted(filenames):
                path = Path(dirpath) / filename
                real = path.resolve()
                if real in seen or not path.is_file():
                    continue
                seen.add(real)
                if filename.endswith(CODE_SUFFIXES):
                    code.append(path)
                elif filename.endswith(TEXT_SUFFIXES):
                    text.append(path)
    return code, text


class ByteTokenizer:
    """The fallback tokenizer: one id per UTF-8 byte, after the three text specials."""

    name = "byte-level (id = byte + 3)"
    text_size = 256 + BYTE_OFFSET

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET
            for text in texts
        ]


class ProjectTokenizer:
    """A project tokenizer folder (``tokenizer.json``, ``vocab_layout.json``)."""

    def __init__(self, folder: Path) -> None:
        from data.text_tokenizer import TextTokenizer

        self.tok = TextTokenizer.load(folder)
        self.name = f"{folder} ({self.tok.fingerprint()})"
        self.text_size = self.tok.layout.text_size
        self.folder = folder

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self.tok.encode_batch(texts)]


def documents_of(files: list[Path], tokenizer, doc_tokens: int, want: int, seed: int):
    """Documents of about ``doc_tokens`` tokens from ``files`` in order: a long file cut in
    pieces, short files joined (as a repository's files are), each length drawn between half and
    one and a half times ``doc_tokens``; every document ends with eos. Yields int32 arrays."""
    if want <= 0:
        return
    rng = np.random.default_rng(seed)
    target = int(rng.integers(doc_tokens // 2, doc_tokens * 3 // 2 + 1))
    pending: list[np.ndarray] = []
    held = 0
    made = 0
    batch_files = 256
    for start in range(0, len(files), batch_files):
        texts = []
        for path in files[start : start + batch_files]:
            content = path.read_text("utf-8", errors="replace").strip()
            if content:
                texts.append(content + "\n")
        for ids in tokenizer.encode_batch(texts):
            offset = 0
            while offset < len(ids):
                take = min(len(ids) - offset, target - 1 - held)
                pending.append(ids[offset : offset + take])
                held += take
                offset += take
                if held >= target - 1:
                    pending.append(np.array([EOS_ID], np.int32))
                    yield np.concatenate(pending)
                    made += 1
                    if made == want:
                        return
                    pending, held = [], 0
                    target = int(rng.integers(doc_tokens // 2, doc_tokens * 3 // 2 + 1))


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_token_source(folder: Path, name: str, docs, modality: int) -> list[dict]:
    """One token source of the corpus in earlyfuse's format: shards of ``DOCS_PER_SHARD``
    documents (tar, JSONL index, binary index), written by the project's own writers."""
    from data.schema import Sample
    from data.shards import token_index
    from data.shards.writer import ShardWriter
    from data.vocab import MODALITY_NAMES

    kind = MODALITY_NAMES[modality]
    src = folder / name
    src.mkdir(parents=True)
    entries: list[dict] = []
    writer: ShardWriter | None = None
    count = tokens = 0

    def close() -> None:
        assert writer is not None
        res = writer.close()
        stem = src / f"shard-{len(entries):06d}"
        jsonl = Path(f"{stem}.idx.jsonl").read_bytes()
        token_index.write(Path(f"{stem}{token_index.SUFFIX}"), token_index.build(jsonl))
        entries.append(
            {
                "path": f"{name}/{stem.name}.tar",
                "index": f"{name}/{stem.name}.idx.jsonl",
                "index_bin": f"{name}/{stem.name}{token_index.SUFFIX}",
                "source": name,
                "samples": count,
                "tokens": {kind: tokens},
                "blocks": {mod: {"blocks": 0, "longest": 0} for mod in ("image", "video")},
                "bytes": res.bytes,
                "sha256": res.sha256,
                "index_sha256": res.index_sha256,
            }
        )

    for number, ids in enumerate(docs):
        if writer is None:
            stem = src / f"shard-{len(entries):06d}"
            writer = ShardWriter(Path(f"{stem}.tar"), Path(f"{stem}.idx.jsonl"))
            count = tokens = 0
        mod = np.full(len(ids), modality, np.uint8)
        sample = Sample(
            f"{name}{number:08d}",
            {"source": name, "spans": [], "tokens": len(ids)},
            [("ids.npy", npy_bytes(ids)), ("mod.npy", npy_bytes(mod))],
        )
        writer.write(sample, {"tokens": len(ids), "tokens_by_modality": {kind: len(ids)}})
        count += 1
        tokens += len(ids)
        if count == DOCS_PER_SHARD:
            close()
            writer = None
    if writer is not None:
        close()
    return entries


def visual_sources(token_dir: Path) -> list[dict]:
    """The sources of a token folder that hold image or video tokens."""
    manifest = json.loads((token_dir / "manifest.json").read_text())
    return [
        src
        for src in manifest["sources"]
        if src["tokens"].get("image", 0) or src["tokens"].get("video", 0)
    ]


def copy_visual(token_dir: Path, out: Path) -> list[dict]:
    """The visual sources' shards, hard-linked (copied across file systems) into ``out``."""
    import shutil

    manifest = json.loads((token_dir / "manifest.json").read_text())
    names = {src["name"] for src in visual_sources(token_dir)}
    entries = []
    for entry in manifest["shards"]:
        if entry["source"] not in names:
            continue
        for key in ("path", "index", "index_bin"):
            dest = out / entry[key]
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(token_dir / entry[key], dest)
            except OSError:
                shutil.copy2(token_dir / entry[key], dest)
        entries.append(entry)
    return entries


def corpus_settings(a) -> dict:
    return {
        "version": CORPUS_VERSION,
        "docs": a.docs,
        "doc_tokens": a.doc_tokens,
        "text_share": a.text_share,
        "material": [str(path) for path in (a.material or default_material())],
        "tokenizer": str(a.tokenizer) if a.tokenizer else None,
        "visual": str(a.visual) if a.visual else None,
    }


def build_corpus(a) -> dict:
    """The earlyfuse token folder of the corpus under ``a.corpus / "tokens"`` (built once; a
    corpus built with other settings is refused, never silently reused)."""
    import shutil

    from data.vocab import Modality, VocabLayout

    settings = corpus_settings(a)
    record = a.corpus / "corpus.json"
    if record.is_file():
        built = json.loads(record.read_text())
        if built["settings"] != settings:
            raise SystemExit(
                f"{record}: the corpus there was built with {built['settings']}, not "
                f"{settings}; pass another --corpus or delete that folder"
            )
        return built
    tokens_dir = a.corpus / "tokens"
    if tokens_dir.exists():  # a build that was interrupted
        shutil.rmtree(tokens_dir)
    tokens_dir.mkdir(parents=True)
    tokenizer: ProjectTokenizer | ByteTokenizer
    if a.visual:
        tokenizer = ProjectTokenizer(a.visual / "tokenizers")
    elif a.tokenizer:
        tokenizer = ProjectTokenizer(a.tokenizer)
    else:
        tokenizer = ByteTokenizer()
    code_files, text_files = material_files([Path(p) for p in settings["material"]])
    code_chars = sum(path.stat().st_size for path in code_files)
    text_chars = sum(path.stat().st_size for path in text_files)
    # Prose is rare among these files (~3 % of a site-packages' bytes): its share of the
    # documents is set (--text-share), as far as the material has it; code fills the rest.
    shards = write_token_source(
        tokens_dir,
        "text",
        documents_of(text_files, tokenizer, a.doc_tokens, round(a.docs * a.text_share), seed=2),
        int(Modality.TEXT),
    )
    text_docs = sum(entry["samples"] for entry in shards)
    print(
        f"corpus: {len(code_files):,} code files ({code_chars / 1e6:.0f} MB), "
        f"{len(text_files):,} text files ({text_chars / 1e6:.0f} MB); tokenizer {tokenizer.name}",
        flush=True,
    )
    shards += write_token_source(
        tokens_dir,
        "code",
        documents_of(code_files, tokenizer, a.doc_tokens, a.docs - text_docs, seed=1),
        int(Modality.CODE),
    )
    sources = []
    for name in ("text", "code"):
        mine = [entry for entry in shards if entry["source"] == name]
        sources.append(
            {
                "name": name,
                "samples": sum(entry["samples"] for entry in mine),
                "tokens": {name: sum(sum(entry["tokens"].values()) for entry in mine)},
            }
        )
    if a.visual:
        shards += copy_visual(a.visual, tokens_dir)
        sources += visual_sources(a.visual)
        shutil.copytree(a.visual / "tokenizers", tokens_dir / "tokenizers")
        tok_record = json.loads((a.visual / "manifest.json").read_text())["tokenizers"]
    else:
        folder = tokens_dir / "tokenizers"
        if a.tokenizer:
            shutil.copytree(a.tokenizer, folder)
            layout = VocabLayout.load(folder / "vocab_layout.json")
        else:
            folder.mkdir()
            layout = VocabLayout(text_size=tokenizer.text_size)
            layout.save(folder / "vocab_layout.json")
        tok_record = {
            "text": tokenizer.name,
            "layout": layout.fingerprint(),
            "visual": "none",
            "folder": "tokenizers",
        }
    samples = sum(src["samples"] for src in sources)
    total = sum(sum(src["tokens"].values()) for src in sources)
    if sum(src["samples"] for src in sources[:2]) < a.docs:
        print(
            f"corpus: the material gave {sum(src['samples'] for src in sources[:2]):,} text and "
            f"code documents, not {a.docs:,} (add folders with --material)",
            flush=True,
        )
    manifest = {
        "format": "earlyfuse-token-shards",
        "version": 1,
        "fingerprint": f"bench-peers-{CORPUS_VERSION}-{samples}-{total}",
        "tokenizers": tok_record,
        "sources": sources,
        "shards": shards,
        "totals": {"samples": samples, "tokens": total, "rejects": 0},
    }
    (tokens_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    built = {
        "settings": settings,
        "documents": samples,
        "tokens": total,
        "sources": {
            src["name"]: {"documents": src["samples"], "tokens": sum(src["tokens"].values())}
            for src in sources
        },
        "tokenizer": tokenizer.name,
    }
    record.write_text(json.dumps(built, indent=1))
    return built


def read_documents(tokens: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document of the token folder in shard order: (ids int32, modalities uint8)."""
    from data.loader.npy import read_npy
    from data.loader.store import ShardFiles
    from data.token_docs import source_tables

    files, docs = ShardFiles(), []
    for table in source_tables(tokens):
        for number in range(len(table)):
            rec = table.token_sample(number)
            url = table.shards[rec.shard]
            ids = read_npy(files.view(url, *rec.ids_at)).copy()
            mod = read_npy(files.view(url, *rec.mod_at)).copy()
            docs.append((ids.astype(np.int32), mod.astype(np.uint8)))
    return docs


# --- conversions into the peers' formats (untimed, cached beside the corpus) ---------------------
def to_webdataset(docs, out: Path) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    for start in range(0, len(docs), DOCS_PER_SHARD):
        url = str(out / f"shard-{start // DOCS_PER_SHARD:06d}.tar")
        with wds.TarWriter(url) as writer:
            for number, (ids, mod) in enumerate(docs[start : start + DOCS_PER_SHARD], start):
                writer.write({"__key__": f"d{number:08d}", "ids.npy": ids, "mod.npy": mod})


def wds_urls(out: Path) -> list[str]:
    return [str(path) for path in sorted(out.glob("shard-*.tar"))]


def to_streaming(docs, out: Path) -> None:
    from streaming import MDSWriter

    with MDSWriter(
        out=str(out), columns={"ids": "ndarray:int32", "mod": "ndarray:uint8"}
    ) as writer:
        for ids, mod in docs:
            writer.write({"ids": ids, "mod": mod})


def to_litdata(docs, out: Path) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_bytes="64MB")
    for number, (ids, mod) in enumerate(docs):
        writer.add_item(number, {"ids": ids, "mod": mod})
    writer.done()
    writer.merge()


def to_litdata_tokens(docs, out: Path, seq_len: int) -> None:
    """One token stream for ``TokensLoader``: chunks of a whole number of rows (as LitData's
    ``optimize(..., item_loader=TokensLoader())`` writes them)."""
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_size=seq_len * 8192, item_loader=TokensLoader())
    for number, (ids, mod) in enumerate(docs):
        writer.add_item(number, (ids << MOD_BITS) | mod.astype(np.int32))
    writer.done()
    writer.merge()


def to_energon(wds_dir: Path) -> None:
    from megatron.energon import BaseWebdatasetFactory

    BaseWebdatasetFactory.prepare_dataset(
        wds_dir,
        [Path(url).name for url in wds_urls(wds_dir)],
        split_parts_ratio=[("train", 1.0)],
        shuffle_seed=None,
        workers=1,
    )
    (wds_dir / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    )


def convert(corpus: Path, loaders: list[str], seq_len: int) -> None:
    """Each peer's copy of the corpus, made once (a marker file says it is complete)."""
    import shutil

    docs = None
    targets = {
        "webdataset": ("wds", lambda docs, out: to_webdataset(docs, out)),
        "streaming": ("mds", lambda docs, out: to_streaming(docs, out)),
        "litdata": ("litdata", lambda docs, out: to_litdata(docs, out)),
        "litdata-tokens": (
            f"litdata-tokens-{seq_len}",
            lambda docs, out: to_litdata_tokens(docs, out, seq_len),
        ),
    }
    wanted = set(loaders) | ({"webdataset"} if "energon" in loaders else set())
    for name in [name for name in targets if name in wanted]:
        folder, make = targets[name]
        out = corpus / folder
        if (out / ".complete").is_file():
            continue
        if out.exists():
            shutil.rmtree(out)
        if docs is None:
            docs = read_documents(corpus / "tokens")
        print(f"converting the corpus for {name} into {out}", flush=True)
        make(docs, out)
        (out / ".complete").write_text("")
    if "energon" in loaders and not (corpus / "wds" / ".nv-meta" / ".complete").is_file():
        print(f"preparing {corpus / 'wds'} for energon", flush=True)
        to_energon(corpus / "wds")
        (corpus / "wds" / ".nv-meta" / ".complete").write_text("")


# --- the packing every peer gets -------------------------------------------------------------------
class MinimalPacker:
    """Documents -> batches of ``rows`` rows of ``seq_len``: ids concatenated and cut (no block
    handling, no labels or positions), what a peer's user would at least write. The last,
    partial batch is handed out too (its real tokens counted), as earlyfuse's epoch ends."""

    def __init__(self, seq_len: int, rows: int) -> None:
        self.seq_len, self.rows = seq_len, rows
        self.ids = np.zeros((rows, seq_len), np.int64)
        self.mod = np.zeros((rows, seq_len), np.int64)
        self.row = self.pos = 0

    def _batch(self, real: int) -> dict:
        import torch

        batch = {
            "input_ids": torch.from_numpy(self.ids),
            "modality": torch.from_numpy(self.mod),
            "num_real_tokens": torch.tensor(real),
        }
        self.ids = np.zeros((self.rows, self.seq_len), np.int64)
        self.mod = np.zeros((self.rows, self.seq_len), np.int64)
        self.row = self.pos = 0
        return batch

    def add(self, doc_ids: np.ndarray, doc_mod: np.ndarray):
        """The batches this document completes."""
        start, size = 0, len(doc_ids)
        while start < size:
            take = min(size - start, self.seq_len - self.pos)
            self.ids[self.row, self.pos : self.pos + take] = doc_ids[start : start + take]
            self.mod[self.row, self.pos : self.pos + take] = doc_mod[start : start + take]
            start += take
            self.pos += take
            if self.pos == self.seq_len:
                self.row, self.pos = self.row + 1, 0
                if self.row == self.rows:
                    yield self._batch(self.rows * self.seq_len)

    def finish(self):
        real = self.row * self.seq_len + self.pos
        if real:
            yield self._batch(real)

    def batches(self, docs):
        for doc_ids, doc_mod in docs:
            yield from self.add(doc_ids, doc_mod)
        yield from self.finish()


# --- the peers' document streams (one epoch) -------------------------------------------------------
def wds_docs(corpus: Path, rows: int):
    import webdataset as wds

    dataset = (
        wds.WebDataset(wds_urls(corpus / "wds"), shardshuffle=False, empty_check=False)
        .decode()
        .to_tuple("ids.npy", "mod.npy")
    )
    yield from dataset


def streaming_docs(corpus: Path, rows: int):
    from streaming import StreamingDataset

    # batch_size: the documents of a batch, about; Streaming derives its read-ahead from it
    dataset = StreamingDataset(local=str(corpus / "mds"), shuffle=False, batch_size=rows)
    for sample in dataset:
        yield sample["ids"], sample["mod"]


def litdata_docs(corpus: Path, rows: int):
    from litdata import StreamingDataset

    for sample in StreamingDataset(str(corpus / "litdata")):
        yield sample["ids"], sample["mod"]


class PeerDataset:
    """A peer's documents packed where they arrive (a torch IterableDataset, made in ``make``)."""

    def __init__(self, docs_of, corpus: Path, seq_len: int, rows: int) -> None:
        self.docs_of, self.corpus, self.seq_len, self.rows = docs_of, corpus, seq_len, rows

    def __iter__(self):
        packer = MinimalPacker(self.seq_len, self.rows)
        return packer.batches(self.docs_of(self.corpus, self.rows))


def in_worker(dataset, workers: int):
    """``dataset``'s batches, in this process (0) or through a DataLoader worker."""
    if workers == 0:
        return iter(dataset)
    from torch.utils.data import DataLoader, IterableDataset

    class Wrapped(IterableDataset):
        def __iter__(self):
            return iter(dataset)

    return iter(DataLoader(Wrapped(), batch_size=None, num_workers=workers))


class TokenBlocks:
    """LitData's ``TokensLoader`` blocks of ``seq_len`` stacked into batches of ``rows``."""

    def __init__(self, corpus: Path, seq_len: int, rows: int) -> None:
        self.corpus, self.seq_len, self.rows = corpus, seq_len, rows

    def __iter__(self):
        import torch
        from litdata import StreamingDataset
        from litdata.streaming.item_loader import TokensLoader

        dataset = StreamingDataset(
            str(self.corpus / f"litdata-tokens-{self.seq_len}"),
            item_loader=TokensLoader(block_size=self.seq_len),
        )
        pending = []
        for block in dataset:
            pending.append(block)
            if len(pending) == self.rows:
                yield self._batch(torch, pending)
                pending = []
        if pending:
            yield self._batch(torch, pending)

    def _batch(self, torch, blocks) -> dict:
        packed = torch.from_numpy(np.stack(blocks).astype(np.int64))
        return {
            "input_ids": packed >> MOD_BITS,
            "modality": packed & ((1 << MOD_BITS) - 1),
            "num_real_tokens": torch.tensor(packed.numel()),
        }


def energon_batches(corpus: Path, workers: int, seq_len: int, rows: int):
    """Energon's own loader: its sample decoder decodes the ``.npy`` members, its worker cooks the
    samples and packs them (``encode_batch`` feeds a packer kept per worker)."""
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        basic_sample_keys,
        edataclass,
        get_loader,
        get_train_dataset,
        stateless,
    )

    @edataclass
    class TokenSample(Sample):
        ids: np.ndarray
        mod: np.ndarray

    @stateless
    def cook(crude: dict) -> TokenSample:
        ids, mod = crude["ids.npy"], crude["mod.npy"]
        if not isinstance(ids, np.ndarray) or not isinstance(mod, np.ndarray):
            raise TypeError(
                f"{crude['__key__']}: Energon's decoder left the .npy members undecoded"
            )
        return TokenSample(**basic_sample_keys(crude), ids=ids, mod=mod)

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        def __init__(self) -> None:
            super().__init__()
            self.packer = MinimalPacker(seq_len, rows)

        def batch(self, samples):
            return samples

        def encode_batch(self, samples):  # runs in Energon's worker
            out = []
            for sample in samples:
                out.extend(self.packer.add(sample.ids, sample.mod))
            return out

    dataset = get_train_dataset(
        str(corpus / "wds"),
        batch_size=64,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        task_encoder=Encoder(),
    )
    loader = get_loader(dataset)

    def batches():
        for packed in loader:
            yield from packed

    return batches()


def earlyfuse_batches(corpus: Path, workers: int, seq_len: int, rows: int):
    from data.loader import LoaderConfig, SourceConfig, build_loader

    tokens = corpus / "tokens"
    manifest = json.loads((tokens / "manifest.json").read_text())
    cfg = LoaderConfig(
        sources=[
            SourceConfig(
                name=src["name"],
                shards=[str(tokens / src["name"])],
                weight=float(sum(src["tokens"].values())),
            )
            for src in manifest["sources"]
        ],
        seq_len=seq_len,
        num_workers=workers,
        mode="epoch",
    )
    return iter(build_loader(cfg, rank=0, world_size=1, micro_batch=rows))


def library_of(name: str) -> str:
    return "data.loader" if name == "earlyfuse" else PEERS[name]


def make_batches(name: str, corpus: Path, workers: int, seq_len: int, rows: int):
    if name == "earlyfuse":
        return earlyfuse_batches(corpus, workers, seq_len, rows)
    if name == "energon":
        return energon_batches(corpus, workers, seq_len, rows)
    if name == "litdata-tokens":
        return in_worker(TokenBlocks(corpus, seq_len, rows), workers)
    docs_of = {"webdataset": wds_docs, "streaming": streaming_docs, "litdata": litdata_docs}[name]
    return in_worker(PeerDataset(docs_of, corpus, seq_len, rows), workers)


def measure(name: str, corpus: Path, workers: int, seq_len: int, rows: int, limit: int) -> dict:
    """One loader, one epoch (or ``limit`` batches), in this process: what the child prints."""
    import torch  # every loader hands out torch tensors: not counted as any library's import

    torch.manual_seed(0)
    started = time.perf_counter()
    importlib.import_module(library_of(name))
    imported = time.perf_counter()
    batches = make_batches(name, corpus, workers, seq_len, rows)
    built = time.perf_counter()
    first = next(batches)
    first_at = time.perf_counter()
    tokens, count = int(first["num_real_tokens"]), 1
    for batch in batches:
        tokens += int(batch["num_real_tokens"])
        count += 1
        if count == limit:
            break
    done = time.perf_counter()
    return {
        "import_s": imported - started,
        "build_s": built - imported,
        "first_batch_s": first_at - built,
        "epoch_s": done - imported,
        "tokens": tokens,
        "batches": count,
        "tokens_per_s": tokens / (done - imported),
    }


# --- the parent: fresh processes, memory of their trees ------------------------------------------
def tree_of(root: int) -> list[int]:
    """``root`` and its descendants (``/proc/PID/task/TID/children``)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    todo.extend(int(child) for child in children.read().split())
        except OSError:  # ended meanwhile
            continue
    return found


def memory_of(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in bytes summed over ``pids``. PSS shares each page among the processes that
    map it, so forked workers' copy-on-write pages are not counted twice."""
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for line in rollup:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def run_measure(a, name: str, workers: int, limit: int = 0) -> dict:
    """``name`` measured in a fresh process, its tree's peak memory sampled meanwhile."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--measure",
            name,
            "--corpus",
            str(a.corpus),
            "--workers",
            str(workers),
            "--seq-len",
            str(a.seq_len),
            "--rows",
            str(a.rows),
            "--limit",
            str(limit),
            "--result",
            result.name,
        ]
        child = subprocess.Popen(cmd)
        peak = [0, 0]

        def sample() -> None:
            while child.poll() is None:
                rss, pss = memory_of(tree_of(child.pid))
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = child.wait()
        sampler.join()
        if code != 0:
            raise SystemExit(f"{name} (num_workers={workers}) failed with exit code {code}")
        res = json.loads(Path(result.name).read_text())
    res["peak_rss"], res["peak_pss"] = peak
    return res


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    keys = ("import_s", "first_batch_s", "epoch_s", "tokens_per_s", "peak_rss", "peak_pss")
    out = {}
    for name, results in runs.items():
        med = {key: statistics.median(res[key] for res in results) for key in keys}
        rates = [res["tokens_per_s"] for res in results]
        med["spread"] = (max(rates) - min(rates)) / med["tokens_per_s"]
        med["tokens"] = results[0]["tokens"]
        med["all_tokens_per_s"] = rates
        out[name] = med
    return out


def print_mode(mode: str, table: dict[str, dict], previous: dict) -> None:
    base = table.get(BASELINE)
    print(f"\n{mode} (medians; tokens/s over one epoch, start-up counted)")
    print(
        f"  {'loader':15s} {'tokens/s':>12s} {'spread':>7s} {'import':>7s} {'1st batch':>9s} "
        f"{'epoch':>7s} {'peak RSS':>9s} {'peak PSS':>9s}  vs {BASELINE}: speed RSS"
    )
    for name, med in table.items():
        ratio = ""
        if base:
            ratio = (
                f"  {med['tokens_per_s'] / base['tokens_per_s']:5.2f}x "
                f"{med['peak_rss'] / base['peak_rss']:4.2f}x"
            )
        print(
            f"  {name:15s} {med['tokens_per_s']:>12,.0f} {med['spread']:>7.0%} "
            f"{med['import_s']:>6.2f}s {med['first_batch_s']:>8.2f}s {med['epoch_s']:>6.1f}s "
            f"{med['peak_rss'] / 2**20:>6.0f}MiB {med['peak_pss'] / 2**20:>6.0f}MiB{ratio}"
        )
    ours = table.get("earlyfuse")
    if not ours:
        return
    goal = GOALS.get(mode, {})
    now = {"first_batch_s": ours["first_batch_s"]}
    if base:
        now["epoch_vs_litdata"] = ours["tokens_per_s"] / base["tokens_per_s"]
        now["peak_rss_vs_litdata"] = ours["peak_rss"] / base["peak_rss"]
    before = previous.get(mode, {})
    print(f"  earlyfuse now / before ({previous.get('source', 'no previous figures')}) / goal:")
    for key, value in now.items():
        was = before.get(key)
        target = goal.get(key)
        print(
            f"    {key:20s} {value:7.2f}   {'' if was is None else f'{was:7.2f}':>7s}"
            f"   {'' if target is None else target:>5}"
        )


def previous_figures(path: Path | None) -> dict:
    """``PREVIOUS``, or the modes of a result this script saved: earlyfuse's figures and its
    ratios to LitData there."""
    if path is None:
        return PREVIOUS
    saved = json.loads(path.read_text())
    out: dict = {"source": f"{path} ({saved.get('commit', '?')})"}
    for mode, table in saved["modes"].items():
        ours, base = table.get("earlyfuse"), table.get(BASELINE)
        if not ours:
            continue
        out[mode] = {"first_batch_s": ours["first_batch_s"]}
        if base:
            out[mode]["epoch_vs_litdata"] = ours["tokens_per_s"] / base["tokens_per_s"]
            out[mode]["peak_rss_vs_litdata"] = ours["peak_rss"] / base["peak_rss"]
    return out


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog="docs/benchmarks.md, 'The loaders of the field', has the current table.",
    )
    ap.add_argument(
        "--corpus", type=Path, default=Path("runs/bench-peers"), help="where the corpus is cached"
    )
    ap.add_argument("--docs", type=int, default=27_000, help="text and code documents")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="mean tokens a document")
    ap.add_argument("--text-share", type=float, default=0.25, help="of the documents, prose")
    ap.add_argument(
        "--material",
        type=Path,
        nargs="+",
        default=None,
        help="folders of .py (code) and .txt/.rst/.md (text) files "
        "(default: the standard library and site-packages)",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="a project tokenizer folder")
    ap.add_argument("--visual", type=Path, default=None, help="a token folder with visual sources")
    ap.add_argument("--corpus-only", action="store_true", help="build the corpus, measure nothing")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="rows per batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--loaders", nargs="+", default=LOADERS, choices=LOADERS)
    ap.add_argument("--save", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--previous", type=Path, default=None, help="a JSON saved with --save")
    ap.add_argument("--measure", choices=LOADERS, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    if a.measure:  # the child
        figures = measure(a.measure, a.corpus, a.workers[0], a.seq_len, a.rows, a.limit)
        a.result.write_text(json.dumps(figures))
        return figures
    if a.visual and a.tokenizer:
        raise SystemExit("--visual brings its token folder's tokenizer: leave out --tokenizer")
    if a.visual and not (a.visual / "manifest.json").is_file():
        raise SystemExit(f"{a.visual}: no manifest.json; --visual takes a token folder")
    built = build_corpus(a)
    print(
        f"corpus {a.corpus}: {built['documents']:,} documents, {built['tokens']:,} tokens "
        f"({built['tokens'] / built['documents']:,.0f} a document; {built['sources']})",
        flush=True,
    )
    if a.corpus_only:
        return built
    loaders = [name for name in a.loaders if name == "earlyfuse" or available(PEERS[name])]
    for name in a.loaders:
        if name not in loaders:
            print(f"skipped {name}: {PEERS[name]} is not installed")
    convert(a.corpus, loaders, a.seq_len)
    res: dict = {
        "commit": commit(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "corpus": built,
        "seq_len": a.seq_len,
        "rows": a.rows,
        "rounds": a.rounds,
        "load_before": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "modes": {},
    }
    previous = previous_figures(a.previous)
    for workers in a.workers:
        for name in loaders:  # untimed: page cache, the libraries' on-disk caches
            run_measure(a, name, workers, limit=20)
        runs: dict[str, list[dict]] = {name: [] for name in loaders}
        for round_number in range(a.rounds):
            shift = round_number % len(loaders)
            for name in loaders[shift:] + loaders[:shift]:
                runs[name].append(run_measure(a, name, workers))
                print(
                    f"  round {round_number + 1} {name} num_workers={workers}: "
                    f"{runs[name][-1]['tokens_per_s']:,.0f} tokens/s",
                    flush=True,
                )
        mode = f"workers={workers}"
        res["modes"][mode] = summarize(runs)
        print_mode(mode, res["modes"][mode], previous)
    res["load_after"] = os.getloadavg()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(res, indent=1))
    if a.save:
        a.save.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
