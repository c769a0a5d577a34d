"""earlyfuse's loader against the loaders of the field: one epoch each, start-up included.

The peers (LitData with per-document arrays and with its ``TokensLoader``, MosaicML Streaming,
webdataset, Megatron-Energon) are not dependencies of the project: they live in a virtual
environment of their own; docs/benchmarks.md, "The loaders of the field", has how, the corpus,
the method and the figures. A peer whose package is absent is skipped. The corpus is built once
under ``--corpus`` and converted, untimed, into each peer's format beside it.

    python tools/bench/bench_peers.py --corpus runs/bench-peers [--docs 27000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.tokenize.docs import TokenDoc  # noqa: E402
from tools.bench import (  # noqa: E402
    commit,
    machine,
    medians,
    process_tree,
    report,
    rounds,
    token_loader_config,
    write_token_manifest,
    write_token_shards,
)

# Each loader and the library it imports (a peer whose library is absent is skipped).
LIBRARIES = {
    "earlyfuse": "data.loader",
    # earlyfuse's in-process loader in the peers' worker wrapper: its batches through torch's
    # worker queue, as theirs, not through its own ring of shared slots (one worker or more)
    "earlyfuse-queue": "data.loader",
    "litdata": "litdata",
    "litdata-tokens": "litdata",
    "streaming": "streaming",
    "webdataset": "webdataset",
    "energon": "megatron.energon",
}
LOADERS = list(LIBRARIES)
BASELINE = "litdata"
CODE_SUFFIXES = (".py",)
TEXT_SUFFIXES = (".txt", ".rst", ".md")
DOCS_PER_SHARD = 1000
BYTE_OFFSET = 3  # the byte-level fallback's ids: after <|pad|>, <|bos|>, <|eos|>
EOS_ID = 2
IMAGE = 2  # Modality.IMAGE: image, video (3) and structure (4) tokens make the visual blocks
MOD_BITS = 3  # LitData TokensLoader: id * 8 + modality in one int32
PAD_MOD = 7  # ... and in its stream, the padding that keeps a visual block inside one row
CORPUS_VERSION = 1

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
    paths = (Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib"))
    return [path for path in dict.fromkeys(paths) if path.is_dir()]


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
    held = made = 0
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


def write_token_source(folder: Path, name: str, docs, modality: int) -> list[dict]:
    """One token source of the corpus in earlyfuse's format, shards of ``DOCS_PER_SHARD``
    documents: its manifest's shard entries."""
    numbered = (
        TokenDoc(f"{name}{number:08d}", ids, np.full(len(ids), modality, np.uint8))
        for number, ids in enumerate(docs)
    )
    return write_token_shards(folder, name, numbered, DOCS_PER_SHARD)


def copy_visual(token_dir: Path, out: Path) -> list[dict]:
    """The shards of the sources of a token folder that hold image or video tokens, hard-linked
    (copied across file systems) into ``out``: their manifest entries."""
    manifest = json.loads((token_dir / "manifest.json").read_text())
    names = {
        src["name"]
        for src in manifest["sources"]
        if src["tokens"].get("image") or src["tokens"].get("video")
    }
    entries = [entry for entry in manifest["shards"] if entry["source"] in names]
    for entry in entries:
        for key in ("path", "index", "index_bin"):
            (out / entry[key]).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(token_dir / entry[key], out / entry[key])
            except OSError:
                shutil.copy2(token_dir / entry[key], out / entry[key])
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


def corpus_tokenizer(a, folder: Path) -> tuple[ProjectTokenizer | ByteTokenizer, dict]:
    """The text and code tokenizer, its folder copied to ``folder`` (the token folder's
    ``tokenizers/``) and the manifest's record of it. With ``--visual``, that folder's
    tokenizers: the byte-level ids, or ``--tokenizer`` when it is the same text tokenizer."""
    from data.vocab import VocabLayout

    tokenizer = ProjectTokenizer(a.tokenizer) if a.tokenizer else ByteTokenizer()
    if a.visual:
        shutil.copytree(a.visual / "tokenizers", folder)
        record = json.loads((a.visual / "manifest.json").read_text())["tokenizers"]
        layout = VocabLayout.load(folder / "vocab_layout.json")
        if (
            isinstance(tokenizer, ProjectTokenizer)
            and tokenizer.tok.fingerprint() != record["text"]
        ):
            raise SystemExit(
                f"{a.tokenizer}: not the text tokenizer of {a.visual} ({record['text']}); with "
                "--visual, give that folder's tokenizers/ or no --tokenizer (byte-level ids)"
            )
        if tokenizer.text_size > layout.text_size:
            raise SystemExit(
                f"{a.visual}: its vocabulary's text range ({layout.text_size} ids) cannot hold "
                f"the byte-level ids ({tokenizer.text_size})"
            )
        return tokenizer, record
    if a.tokenizer:
        shutil.copytree(a.tokenizer, folder)
        layout = VocabLayout.load(folder / "vocab_layout.json")
    else:
        folder.mkdir()
        layout = VocabLayout(text_size=tokenizer.text_size)
        layout.save(folder / "vocab_layout.json")
    record = {"text": tokenizer.name, "layout": layout.fingerprint(), "visual": "none"}
    return tokenizer, {**record, "folder": "tokenizers"}


def build_corpus(a) -> dict:
    """The earlyfuse token folder of the corpus under ``a.corpus / "tokens"`` (built once; a
    corpus built with other settings is refused, never silently reused)."""
    from data.vocab import Modality

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
    tokenizer, tok_record = corpus_tokenizer(a, tokens_dir / "tokenizers")
    code_files, text_files = material_files([Path(p) for p in settings["material"]])
    print(
        f"corpus: {len(code_files):,} code files "
        f"({sum(path.stat().st_size for path in code_files) / 1e6:.0f} MB), {len(text_files):,} "
        f"text files ({sum(path.stat().st_size for path in text_files) / 1e6:.0f} MB); "
        f"tokenizer {tokenizer.name}",
        flush=True,
    )
    # Prose is rare among these files (~3 % of a site-packages' bytes): its share of the
    # documents is set (--text-share), as far as the material has it; code fills the rest.
    text_docs = documents_of(
        text_files, tokenizer, a.doc_tokens, round(a.docs * a.text_share), seed=2
    )
    shards = write_token_source(tokens_dir, "text", text_docs, int(Modality.TEXT))
    made = sum(entry["samples"] for entry in shards)
    code_docs = documents_of(code_files, tokenizer, a.doc_tokens, a.docs - made, seed=1)
    shards += write_token_source(tokens_dir, "code", code_docs, int(Modality.CODE))
    made = sum(entry["samples"] for entry in shards)
    if made < a.docs:
        print(
            f"corpus: the material gave {made:,} text and code documents, not {a.docs:,} (add "
            "folders with --material)",
            flush=True,
        )
    visual = copy_visual(a.visual, tokens_dir) if a.visual else []
    samples = made + sum(entry["samples"] for entry in visual)
    total = sum(sum(entry["tokens"].values()) for entry in shards + visual)
    fingerprint = f"bench-peers-{CORPUS_VERSION}-{samples}-{total}"
    sources = write_token_manifest(tokens_dir, fingerprint, tok_record, shards + visual)["sources"]
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
    if a.visual:
        built["visual_share"] = {
            "documents": round(sum(entry["samples"] for entry in visual) / samples, 4),
            "tokens": round(sum(sum(entry["tokens"].values()) for entry in visual) / total, 4),
        }
    record.write_text(json.dumps(built, indent=1))
    return built


def read_documents(tokens: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document of the token folder in shard order: (ids int32, modalities uint8). The
    peers find a document's visual blocks from its modalities alone (``spans_of``): a document
    whose blocks are not those runs (two blocks side by side) is refused, as is a document that
    cannot be read."""
    from data.token_docs import iter_documents, source_tables

    skipped: list[tuple[str, str, str]] = []
    docs = []
    for doc in iter_documents(source_tables(tokens), skipped=skipped):
        found = [(start, end) for start, end, block in spans_of(doc.modality) if block]
        if found != sorted((int(blk[0]), int(blk[1])) for blk in doc.blocks):
            raise SystemExit(
                f"{tokens}: document {doc.key} of source {doc.source}: its visual blocks "
                f"{doc.blocks} are not its runs of image, video and structure tokens {found}"
            )
        docs.append((doc.ids.astype(np.int32), doc.modality.astype(np.uint8)))
    if skipped:
        raise SystemExit(f"{tokens}: {len(skipped)} unreadable document(s), first {skipped[0]}")
    return docs


# --- the packing work every loader does ----------------------------------------------------------
def spans_of(mod: np.ndarray) -> list[tuple[int, int, bool]]:
    """A document's stretches (start, end, is a visual block): its blocks, runs of image, video
    and structure tokens, kept whole, and the text and code between them, cut anywhere."""
    if not len(mod) or mod.max() < IMAGE:  # text and code only: most documents, one pass
        return [(0, len(mod), False)]
    visual = mod >= IMAGE
    cuts = [0, *(np.flatnonzero(visual[1:] != visual[:-1]) + 1).tolist(), len(mod)]
    return [(start, end, bool(visual[start])) for start, end in zip(cuts, cuts[1:])]


def starts_next_row(pos: int, start: int, end: int, block: bool, seq_len: int) -> bool:
    """Whether the stretch [start, end) must start the next row: a visual block that does not
    fit the rest of this one (a block longer than a row is cut like text: it fits no row)."""
    return block and pos + end - start > seq_len >= end - start


class MinimalPacker:
    """Documents -> batches of ``rows`` rows of ``seq_len``: ids and modalities concatenated,
    text and code cut anywhere, a visual block that does not fit the rest of a row moved to the
    next one (the rest of the row is padding, id 0), no labels or positions: what a peer's user
    would at least write. The last, partial batch is handed out too (its real tokens counted),
    as earlyfuse's epoch ends."""

    def __init__(self, seq_len: int, rows: int) -> None:
        self.seq_len, self.rows = seq_len, rows
        self._clear()

    def _clear(self) -> None:
        self.ids = np.zeros((self.rows, self.seq_len), np.int64)
        self.mod = np.zeros((self.rows, self.seq_len), np.int64)
        self.row = self.pos = self.real = 0

    def _batch(self) -> dict:
        import torch

        batch = {
            "input_ids": torch.from_numpy(self.ids),
            "modality": torch.from_numpy(self.mod),
            "num_real_tokens": torch.tensor(self.real),
        }
        self._clear()
        return batch

    def _next_row(self):
        self.row, self.pos = self.row + 1, 0
        if self.row == self.rows:
            yield self._batch()

    def add(self, doc_ids: np.ndarray, doc_mod: np.ndarray):
        """The batches this document completes."""
        for start, end, block in spans_of(doc_mod):
            if starts_next_row(self.pos, start, end, block, self.seq_len):
                yield from self._next_row()
            while start < end:
                take = min(end - start, self.seq_len - self.pos)
                self.ids[self.row, self.pos : self.pos + take] = doc_ids[start : start + take]
                self.mod[self.row, self.pos : self.pos + take] = doc_mod[start : start + take]
                start += take
                self.pos += take
                self.real += take
                if self.pos == self.seq_len:
                    yield from self._next_row()

    def batches(self, docs):
        for doc_ids, doc_mod in docs:
            yield from self.add(doc_ids, doc_mod)
        if self.real:
            yield self._batch()


def row_aligned(docs, seq_len: int):
    """The documents as ``TokensLoader`` items (id * 8 + modality, int32), padded (``PAD_MOD``)
    where ``MinimalPacker`` would start a row: LitData cuts rows at fixed offsets of one stream,
    so a visual block is kept whole when the stream is written (``optimize`` time, untimed)."""
    pos = 0
    for ids, mod in docs:
        stream = (ids << MOD_BITS) | mod.astype(np.int32)
        pieces = []
        for start, end, block in spans_of(mod):
            if starts_next_row(pos, start, end, block, seq_len):
                pieces.append(np.full(seq_len - pos, PAD_MOD, np.int32))
                pos = 0
            pieces.append(stream[start:end])
            pos = (pos + end - start) % seq_len
        yield pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


# --- conversions into the peers' formats (untimed, cached beside the corpus) ---------------------
def to_webdataset(docs, out: Path) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    pattern = str(out / "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=DOCS_PER_SHARD, verbose=0) as writer:
        for number, (ids, mod) in enumerate(docs):
            writer.write({"__key__": f"d{number:08d}", "ids.npy": ids, "mod.npy": mod})


def to_streaming(docs, out: Path) -> None:
    from streaming import MDSWriter

    columns = {"ids": "ndarray:int32", "mod": "ndarray:uint8"}
    with MDSWriter(out=str(out), columns=columns) as writer:
        for ids, mod in docs:
            writer.write({"ids": ids, "mod": mod})


def to_litdata(docs, out: Path, seq_len: int = 0) -> None:
    """LitData chunks of per-document arrays, or (``seq_len``) one token stream for
    ``TokensLoader``, in chunks of a whole number of rows (as LitData's ``optimize(...,
    item_loader=TokensLoader())`` writes them)."""
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter

    if seq_len:
        writer = BinaryWriter(str(out), chunk_size=seq_len * 8192, item_loader=TokensLoader())
        items = row_aligned(docs, seq_len)
    else:
        writer = BinaryWriter(str(out), chunk_bytes="64MB")
        items = ({"ids": ids, "mod": mod} for ids, mod in docs)
    for number, item in enumerate(items):
        writer.add_item(number, item)
    writer.done()
    writer.merge()


def convert(corpus: Path, loaders: list[str], seq_len: int) -> None:
    """Each peer's copy of the corpus, made once (a marker file says it is complete)."""
    formats: dict[str, tuple[str, Callable]] = {  # loader: (folder, writer); Energon: wds
        "webdataset": ("wds", to_webdataset),
        "streaming": ("mds", to_streaming),
        "litdata": ("litdata", to_litdata),
        "litdata-tokens": (f"litdata-tokens-{seq_len}", partial(to_litdata, seq_len=seq_len)),
    }
    wanted = set(loaders) | ({"webdataset"} if "energon" in loaders else set())
    docs = None
    for name, (folder, write) in formats.items():
        out = corpus / folder
        if name not in wanted or (out / ".complete").is_file():
            continue
        shutil.rmtree(out, ignore_errors=True)
        docs = docs if docs is not None else read_documents(corpus / "tokens")
        print(f"converting the corpus for {name} into {out}", flush=True)
        write(docs, out)
        (out / ".complete").write_text("")
    meta = corpus / "wds" / ".nv-meta"
    if "energon" in loaders and not (meta / ".complete").is_file():
        from megatron.energon import BaseWebdatasetFactory

        print(f"preparing {corpus / 'wds'} for energon", flush=True)
        BaseWebdatasetFactory.prepare_dataset(
            corpus / "wds",
            [path.name for path in sorted((corpus / "wds").glob("shard-*.tar"))],
            split_parts_ratio=[("train", 1.0)],
            shuffle_seed=None,
            workers=1,
        )
        (meta / "dataset.yaml").write_text(
            "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
        )
        (meta / ".complete").write_text("")


# --- the loaders (one epoch of batches each) -------------------------------------------------------
def peer_docs(name: str, corpus: Path, rows: int):
    """A peer's documents (ids, modalities) for one epoch, read by its own dataset class."""
    if name == "webdataset":
        import webdataset as wds

        urls = [str(path) for path in sorted((corpus / "wds").glob("shard-*.tar"))]
        dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        return iter(dataset.decode().to_tuple("ids.npy", "mod.npy"))
    if name == "streaming":
        from streaming import StreamingDataset

        # batch_size: the documents of a batch, about; Streaming derives its read-ahead from it
        samples = StreamingDataset(local=str(corpus / "mds"), shuffle=False, batch_size=rows)
    else:
        from litdata import StreamingDataset as LitDataset

        samples = LitDataset(str(corpus / "litdata"))
    return ((sample["ids"], sample["mod"]) for sample in samples)


def token_rows(corpus: Path, seq_len: int, rows: int):
    """LitData's ``TokensLoader`` rows of ``seq_len`` stacked into batches of ``rows``; the
    stream's padding is no real token."""
    import torch
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    folder = str(corpus / f"litdata-tokens-{seq_len}")
    pending = []
    # One pass over the dataset: its iterator, exhausted, would start another epoch if asked again
    for block in StreamingDataset(folder, item_loader=TokensLoader(block_size=seq_len)):
        pending.append(block)
        if len(pending) == rows:
            yield stacked(torch, pending)
            pending = []
    if pending:
        yield stacked(torch, pending)


def stacked(torch, blocks: list) -> dict:
    packed = torch.from_numpy(np.stack(blocks).astype(np.int64))
    mod = packed & ((1 << MOD_BITS) - 1)
    real = mod != PAD_MOD
    return {"input_ids": packed >> MOD_BITS, "modality": mod * real, "num_real_tokens": real.sum()}


def peer_batches(name: str, corpus: Path, seq_len: int, rows: int):
    """A peer's batches, packed where its documents arrive."""
    if name == "litdata-tokens":
        return token_rows(corpus, seq_len, rows)
    return MinimalPacker(seq_len, rows).batches(peer_docs(name, corpus, rows))


def in_worker(batches_of, workers: int):
    """The batches of ``batches_of()``, made in this process (0) or in a DataLoader worker."""
    if workers == 0:
        return batches_of()
    from torch.utils.data import DataLoader, IterableDataset

    class Wrapped(IterableDataset):
        def __iter__(self):
            return batches_of()

    return iter(DataLoader(Wrapped(), batch_size=None, num_workers=workers))


def energon_batches(corpus: Path, workers: int, seq_len: int, rows: int):
    """Energon's own loader: its sample decoder decodes the ``.npy`` members, its worker cooks the
    samples and packs them (``encode_batch`` feeds a packer kept per worker)."""
    from megatron import energon

    @energon.edataclass
    class TokenSample(energon.Sample):
        ids: np.ndarray
        mod: np.ndarray

    @energon.stateless
    def cook(crude: dict) -> TokenSample:
        ids, mod = crude["ids.npy"], crude["mod.npy"]
        if not isinstance(ids, np.ndarray) or not isinstance(mod, np.ndarray):
            raise TypeError(
                f"{crude['__key__']}: Energon's decoder left the .npy members undecoded"
            )
        return TokenSample(**energon.basic_sample_keys(crude), ids=ids, mod=mod)

    class Encoder(energon.DefaultTaskEncoder):
        cookers = [energon.Cooker(cook)]

        def __init__(self) -> None:
            super().__init__()
            self.packer = MinimalPacker(seq_len, rows)

        def batch(self, samples):
            return samples

        def encode_batch(self, samples):  # runs in Energon's worker
            return [out for sample in samples for out in self.packer.add(sample.ids, sample.mod)]

    dataset = energon.get_train_dataset(
        str(corpus / "wds"),
        batch_size=64,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
        worker_config=energon.WorkerConfig(rank=0, world_size=1, num_workers=workers),
        task_encoder=Encoder(),
    )
    return (batch for packed in energon.get_loader(dataset) for batch in packed)


def make_batches(a, name: str, workers: int):
    corpus, seq_len, rows = a.corpus, a.seq_len, a.rows
    if name.startswith("earlyfuse"):
        from data.loader import build_loader

        queue = name == "earlyfuse-queue"
        cfg = token_loader_config(
            corpus / "tokens",
            seq_len,
            num_workers=0 if queue else workers,
            mode="epoch",
            worker_start=a.worker_start,
        )
        if not queue:
            return iter(build_loader(cfg, rank=0, world_size=1, micro_batch=rows))

        def one_consumer():  # each harness worker one consumer of the epoch, as a rank is
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            rank, size = (info.id, info.num_workers) if info else (0, 1)
            return iter(build_loader(cfg, rank=rank, world_size=size, micro_batch=rows))

        return in_worker(one_consumer, workers)
    if name == "energon":
        return energon_batches(corpus, workers, seq_len, rows)
    return in_worker(partial(peer_batches, name, corpus, seq_len, rows), workers)


def measure(a) -> dict:
    """One loader, one epoch, in this process: what the child prints."""
    import torch  # every loader hands out torch tensors: not counted as any library's import

    torch.manual_seed(0)
    started = time.perf_counter()
    importlib.import_module(LIBRARIES[a.measure])
    imported = time.perf_counter()
    batches = make_batches(a, a.measure, a.workers[0])
    built = time.perf_counter()
    first = next(batches)
    first_at = time.perf_counter()
    tokens, count = int(first["num_real_tokens"]), 1
    for batch in batches:
        tokens += int(batch["num_real_tokens"])
        count += 1
    done = time.perf_counter()
    figures = {
        "import_s": imported - started,
        "build_s": built - imported,
        "first_batch_s": first_at - built,
        "epoch_s": done - imported,
        "tokens": tokens,
        "batches": count,
        "tokens_per_s": tokens / (done - imported),
    }
    if a.warm_epoch:  # a second loader and epoch: this process's one-time costs paid
        batches = make_batches(a, a.measure, a.workers[0])
        warm = sum(int(batch["num_real_tokens"]) for batch in batches)
        figures["warm_tokens_per_s"] = warm / (time.perf_counter() - done)
    return figures


# --- the parent: fresh processes, memory of their trees ------------------------------------------
def memory_of(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in bytes summed over ``pids``. PSS shares each page among the processes that
    map it, so forked workers' copy-on-write pages are not counted twice."""
    totals = {"Rss:": 0, "Pss:": 0}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                for field, kib, *_ in (line.split() for line in rollup):
                    if field in totals:
                        totals[field] += int(kib) * 1024
        except OSError:  # ended meanwhile
            continue
    return totals["Rss:"], totals["Pss:"]


def run_measure(a, name: str, workers: int, *, sample: bool = False) -> dict:
    """``name`` measured in a fresh process; ``sample``: its tree's peak memory sampled meanwhile.
    Sampling reads every process's ``smaps_rollup`` (about 15 ms each time for a loader with a
    worker: a third of a core on 2 cores), so a timed round runs unobserved and the memory comes
    from a round of its own."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", name]
        flags = (
            ("corpus", a.corpus),
            ("seq-len", a.seq_len),
            ("rows", a.rows),
            ("worker-start", a.worker_start),
        )
        for flag, value in flags:
            cmd += [f"--{flag}", str(value)]
        cmd += ["--warm-epoch"] if a.warm_epoch and not sample else []  # memory: one epoch
        cmd += ["--workers", str(workers), "--result", result.name]
        child = subprocess.Popen(cmd)
        peak_rss = peak_pss = 0
        while sample and child.poll() is None:  # this process has nothing else to do meanwhile
            rss, pss = memory_of(process_tree(child.pid))
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.05)
        if child.wait() != 0:
            raise SystemExit(
                f"{name} (num_workers={workers}) failed with exit code {child.returncode}"
            )
        res = json.loads(Path(result.name).read_text())
    what = f"{name} num_workers={workers}"
    if sample:
        res["peak_rss"], res["peak_pss"] = peak_rss, peak_pss
        print(f"  {what}: peak {peak_rss / 2**20:,.0f} MiB RSS, {peak_pss / 2**20:,.0f} MiB PSS")
    else:
        print(f"  {what}: {res['tokens_per_s']:,.0f} tokens/s", flush=True)
    return res


def summarize(runs: dict[str, list[dict]], memory: dict[str, dict]) -> dict[str, dict]:
    """Medians of the timed rounds, with the peak memory of each loader's sampled round."""
    keys = ("import_s", "first_batch_s", "epoch_s", "tokens_per_s", "warm_tokens_per_s")
    out = {}
    for name, results in runs.items():
        med = medians({key: [res[key] for res in results] for key in keys if key in results[0]})
        rates = [res["tokens_per_s"] for res in results]
        spread = (max(rates) - min(rates)) / med["tokens_per_s"]
        peaks = {key: memory[name][key] for key in ("peak_rss", "peak_pss")}
        out[name] = {**med, **peaks, "spread": spread, "tokens": results[0]["tokens"]}
        out[name]["all_tokens_per_s"] = rates
    return out


def earlyfuse_figures(table: dict[str, dict]) -> dict[str, float]:
    """earlyfuse's first batch and its ratios to LitData in one mode's table (empty without it)."""
    ours, base = table.get("earlyfuse"), table.get(BASELINE)
    if not ours:
        return {}
    figures = {"first_batch_s": ours["first_batch_s"]}
    if base:
        figures["epoch_vs_litdata"] = ours["tokens_per_s"] / base["tokens_per_s"]
        figures["peak_rss_vs_litdata"] = ours["peak_rss"] / base["peak_rss"]
    return figures


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
    for name, med in table.items():
        if "warm_tokens_per_s" in med and base:
            print(
                f"  {name:15s} second epoch in the same process: {med['warm_tokens_per_s']:,.0f} "
                f"tokens/s, {med['warm_tokens_per_s'] / base['warm_tokens_per_s']:.2f}x {BASELINE}"
            )
    now = earlyfuse_figures(table)
    if not now:
        return
    goal, before = GOALS.get(mode, {}), previous.get(mode, {})
    print(f"  earlyfuse now / before ({previous.get('source', 'no previous figures')}) / goal:")
    for key, value in now.items():
        was, target = before.get(key), goal.get(key)
        print(
            f"    {key:20s} {value:7.2f}   {'' if was is None else f'{was:7.2f}':>7s}"
            f"   {'' if target is None else target:>5}"
        )


def previous_figures(path: Path | None) -> dict:
    """The modes of a result this script saved (``--previous``): earlyfuse's figures and its
    ratios to LitData there."""
    if path is None:
        return {}
    saved = json.loads(path.read_text())
    out: dict = {"source": f"{path} ({saved.get('commit', '?')})"}
    for mode, table in saved["modes"].items():
        if figures := earlyfuse_figures(table):
            out[mode] = figures
    return out


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog="docs/benchmarks.md, 'The loaders of the field', has the current table.",
    )
    add = ap.add_argument
    add("--corpus", type=Path, default=Path("runs/bench-peers"), help="where the corpus is cached")
    add("--docs", type=int, default=27_000, help="text and code documents")
    add("--doc-tokens", type=int, default=2048, help="mean tokens a document")
    add("--text-share", type=float, default=0.25, help="of the documents, prose")
    add(
        "--material",
        type=Path,
        nargs="+",
        default=None,
        help="folders of .py (code) and .txt/.rst/.md (text) files "
        "(default: the standard library and site-packages)",
    )
    add("--tokenizer", type=Path, default=None, help="a project tokenizer folder")
    add(
        "--visual",
        type=Path,
        default=None,
        help="a token folder: its image/video sources join the corpus, its tokenizers/ the "
        "vocabulary (text and code stay byte-level without --tokenizer)",
    )
    add("--corpus-only", action="store_true", help="build the corpus, measure nothing")
    add("--seq-len", type=int, default=2048)
    add("--rows", type=int, default=8, help="rows per batch")
    add("--rounds", type=int, default=3)
    add("--workers", type=int, nargs="+", default=[0, 1])
    add("--loaders", nargs="+", default=LOADERS, choices=LOADERS)
    add(
        "--worker-start",
        choices=("fork", "forkserver"),
        default="fork",
        help="earlyfuse's data.worker_start (the peers fork from the measuring process)",
    )
    add(
        "--warm-epoch",
        action="store_true",
        help="also time a second loader's epoch in each measuring process (its build counted; "
        "the imports, one-time set-up and page cache paid by the first)",
    )
    add("--save", type=Path, default=None, help="write the results as JSON here")
    add("--previous", type=Path, default=None, help="a JSON saved with --save")
    add("--measure", choices=LOADERS, help=argparse.SUPPRESS)
    add("--result", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    if a.measure:  # the child
        figures = measure(a)
        a.result.write_text(json.dumps(figures))
        return figures
    if a.visual and not (a.visual / "manifest.json").is_file():
        raise SystemExit(f"{a.visual}: no manifest.json; --visual takes a token folder")
    built = build_corpus(a)
    print(
        f"corpus {a.corpus}: {built['documents']:,} documents, {built['tokens']:,} tokens "
        f"({built['tokens'] / built['documents']:,.0f} a document; {built['sources']}; "
        f"image/video sources: {built.get('visual_share', 'none')})",
        flush=True,
    )
    if a.corpus_only:
        return built
    loaders = [name for name in a.loaders if available(LIBRARIES[name])]
    for name in a.loaders:
        if name not in loaders:
            print(f"skipped {name}: {LIBRARIES[name]} is not installed")
    convert(a.corpus, loaders, a.seq_len)
    res: dict = {
        "commit": commit(),
        "machine": machine(),
        "corpus": built,
        "seq_len": a.seq_len,
        "rows": a.rows,
        "worker_start": a.worker_start,
        "rounds": a.rounds,
        "load_before": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "modes": {},
    }
    previous = previous_figures(a.previous)
    for workers in a.workers:
        # in-process, earlyfuse-queue is earlyfuse
        mode_loaders = [name for name in loaders if workers or name != "earlyfuse-queue"]
        # Untimed, one epoch each: the page cache and the libraries' on-disk caches warmed, and
        # the peak memory sampled (run_measure says why not in the timed rounds)
        memory = {name: run_measure(a, name, workers, sample=True) for name in mode_loaders}
        runs = rounds(
            {name: partial(run_measure, a, name, workers) for name in mode_loaders}, a.rounds
        )
        mode = f"workers={workers}"
        res["modes"][mode] = summarize(runs, memory)
        print_mode(mode, res["modes"][mode], previous)
    res["load_after"] = os.getloadavg()
    res["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return report(res, a.save)


if __name__ == "__main__":
    main()
