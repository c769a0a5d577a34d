"""The instability suite's data: a small real corpus, tokenized, plus token sources that turn bad
part-way through (docs/monitors.md, "Measured on real instabilities"). Nothing is injected into
training: every pathology is *data* that the real loader reads, in stored order
(``data.shuffle_shards=false``, a small ``data.shuffle_buffer``), so a source written as "healthy
documents, then bad ones" turns bad at a known point of the stream; the loader mixes sources by
tokens, so that point is a known step: ``onset_tokens = step x tokens per step x share``.

Built once under ``ROOT`` (reused while its ``built.json`` matches the options):

- ``base/``: the demo corpus at a small scale and captioned colour squares in both orders (the
  cross-modal dependence probes need both), a 512-token BPE and the untrained debug visual
  tokenizer (real codes, no training time), tokenized.
- ``suite/``: every source the cases read. Long text and code documents are cut into pieces of
  at most ``piece`` tokens, so a batch holds many documents (a 12k-token file would fill 25
  batches of the debug run and make a modality's loss jump with each new file). Sources ending
  in ``_bad`` are a healthy prefix followed by a pathology. ``val`` holds every 10th document,
  left out of the training sources: every case's validation loss is on the same documents.
- ``suite_tv/``: the healthy sources again, pictures and clips tokenized by a visual tokenizer
  *trained* ``vtok_steps`` steps on the base corpus, as a user's own pipeline makes them (flat
  colours map onto a few codes, so a healthy model draws few codes too); text and code are the
  same pieces as ``suite/``'s.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from data.shards.npy import read_npy
from data.shards.reader import iter_shard
from data.tokenize.blocks import visual_blocks
from data.tokenize.docs import TokenDoc
from data.vocab import MODALITY_NAMES, Modality, VocabLayout
from tools.bench import train_subprocess, write_token_manifest, write_token_shards

VERSION = 7  # bump when what is built changes
REPO = Path(__file__).resolve().parents[2]  # the checkout, where the suite's runs start
DOCS_PER_SHARD = 64
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 220, 30),
    "purple": (140, 40, 170),
    "orange": (240, 140, 20),
    "black": (10, 10, 10),
    "white": (245, 245, 245),
}


# --- the base corpus ---------------------------------------------------------------------------------


def colour_square(index: int, rng: np.random.Generator):
    """The ``index``-th of the colour squares (the colours in turn, each a 32x32 PIL image of
    its colour with a little noise) and its colour's name. The monitors' tests
    (tests/test_train/conftest.py) draw theirs here too."""
    from PIL import Image

    name = list(COLOURS)[index % len(COLOURS)]
    pixels = np.clip(np.array(COLOURS[name]) + rng.integers(-6, 7, (32, 32, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8)), name


def _colour_corpus(folder: Path, count: int) -> None:
    """Solid colour squares with "a red square." captions: a caption that is a function of its
    image, so a model that reads its images learns a clear dependence (both directions)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows, docs = [], []
    for i in range(count):
        image, name = colour_square(i, rng)
        image.save(folder / f"c{i:04d}.png")
        rows.append({"image": f"c{i:04d}.png", "caption": f"a {name} square."})
        docs.append(
            {
                "id": f"cf{i:04d}",
                "segments": [
                    {"type": "text", "text": f"a {name} square."},
                    {"type": "image", "path": f"c{i:04d}.png"},
                ],
            }
        )
    (folder / "captions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "caption_first.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))


def build_base(root: Path, *, scale: float, colours: int) -> Path:
    """Raw shards, tokenizers and token shards of the base corpus; returns the token folder."""
    import torch

    from data.demo_corpus import build
    from data.ingest import ingest
    from data.sources import Limits
    from data.train_text_tokenizer import train_text_tokenizer
    from model.visual_tokenizer import vtok_debug
    from train.tasks.vtok import save_visual_tokenizer

    corpus = root / "corpus"
    build(corpus, scale=scale, progress=False)
    _colour_corpus(root / "colours", colours)
    specs = [
        f"code:{corpus / 'code'}",
        f"text:{corpus / 'text'}",
        f"images:{corpus / 'scenes' / 'scenes.jsonl'}",
        f"images:{corpus / 'digits' / 'digits.csv'}",
        f"videos:{corpus / 'clips'}",
        f"interleaved:{corpus / 'interleaved' / 'docs.jsonl'}",
        f"colours=images:{root / 'colours' / 'captions.jsonl'}",
        f"colours_first=interleaved:{root / 'colours' / 'caption_first.jsonl'}",
    ]
    # the interleaved documents name the corpus's photos and clips in sibling folders
    summary = ingest(
        root / "raw", specs, shard_max_samples=64, limits=Limits(allow_outside_paths=True)
    )
    if not summary["finalized"]:
        raise RuntimeError(f"ingest of the suite's corpus did not finish: {summary}")
    train_text_tokenizer([root / "raw"], root / "tok" / "text", vocab_size=512, max_grid=32)
    torch.manual_seed(0)
    vcfg = vtok_debug()
    save_visual_tokenizer(vcfg.build().state_dict(), vcfg, root / "tok" / "visual")
    return _tokenize(root, root / "tokens", root / "tok" / "visual")


def _tokenize(root: Path, out: Path, visual: Path) -> Path:
    """``root/raw`` tokenized into ``out`` with ``root/tok/text`` and the visual tokenizer
    ``visual``, at the suite's small pixel budgets."""
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize

    options = TokenizeOptions(
        image_max_pixels=32 * 32, video_max_pixels=32 * 32, video_max_tokens=240
    )
    tokenize(root / "raw", out, root / "tok" / "text", visual, opts=options)
    return out


def tokenize_trained(root: Path, steps: int) -> Path:
    """The base corpus tokenized again with a visual tokenizer trained ``steps`` steps on it (a
    real ``earlyfuse-train experiment=vtok_debug`` run); returns the token folder."""
    overrides = [
        "experiment=vtok_debug",
        f"run_dir={root / 'vtok'}",
        f"train.steps={steps}",
        "train.progress=false",
        "train.tensorboard=false",
        f"vtok_data.raw=[{root / 'raw'}]",
    ]
    train_subprocess(overrides, "training the suite's visual tokenizer", cwd=REPO)
    return _tokenize(root, root / "tokens_tv", root / "vtok" / "visual_tokenizer")


def read_source(tokens: Path, source: str) -> list[TokenDoc]:
    """Every document of one source of a token folder, in stored order."""
    docs = [
        TokenDoc(
            raw.key,
            read_npy(raw.member("ids.npy")).astype(np.int32),
            read_npy(raw.member("mod.npy")).astype(np.uint8),
            raw.doc["spans"],
            raw.doc["source"],
        )
        for index in sorted((tokens / source).glob("*.idx.jsonl"))
        for raw in iter_shard(index.with_name(index.name.replace(".idx.jsonl", ".tar")), index)
    ]
    if not docs:
        raise ValueError(f"{tokens / source}: no documents")
    return docs


# --- transformations -----------------------------------------------------------------------------------


def split_long(doc: TokenDoc, piece: int) -> list[TokenDoc]:
    """A text or code document cut into pieces of at most ``piece`` tokens, each keeping the
    document's first (bos) and last (eos) token; documents with a visual block stay whole."""
    if visual_blocks(doc.spans) or len(doc.ids) <= piece:
        return [doc]
    body = piece - 2
    out = []
    for i, start in enumerate(range(1, len(doc.ids) - 1, body)):
        end = min(start + body, len(doc.ids) - 1)
        ids = np.concatenate([doc.ids[:1], doc.ids[start:end], doc.ids[-1:]])
        mod = np.concatenate([doc.modality[:1], doc.modality[start:end], doc.modality[-1:]])
        spans = [
            {"type": MODALITY_NAMES[np.bincount(mod).argmax()], "start": 1, "end": len(ids) - 1}
        ]
        out.append(TokenDoc(f"{doc.key}-p{i:03d}", ids, mod, spans, doc.source))
    return out


def garbage(doc: TokenDoc, rng: np.random.Generator, layout: VocabLayout) -> TokenDoc:
    """Every text/code id (bos and eos kept) replaced by a uniformly random text id: a source
    whose extraction broke and now yields noise."""
    ids = doc.ids.copy()
    inner = np.zeros(len(ids), bool)
    inner[1:-1] = True
    inner &= (doc.modality == int(Modality.TEXT)) | (doc.modality == int(Modality.CODE))
    ids[inner] = rng.integers(3, layout.text_size, int(inner.sum()))
    return replace(doc, key=doc.key + "-garbage", ids=ids)


def degenerate_codes(
    doc: TokenDoc, rng: np.random.Generator, layout: VocabLayout, codes: list[int]
) -> TokenDoc:
    """Image codes replaced by ``codes[0]`` 90 % of the time, else one of the others: a visual
    tokenizer that has collapsed onto a handful of codes."""
    ids = doc.ids.copy()
    is_code = (doc.modality == int(Modality.IMAGE)) & (ids >= layout.visual_offset)
    num_codes = int(is_code.sum())
    pick = np.where(rng.random(num_codes) < 0.9, codes[0], rng.choice(codes[1:], num_codes))
    ids[is_code] = layout.visual_offset + pick
    return replace(doc, key=doc.key + "-collapsed", ids=ids)


def prefix_then(
    healthy: list[TokenDoc], bad: list[TokenDoc], *, onset_tokens: int, tail_tokens: int
) -> list[TokenDoc]:
    """Healthy documents (cycled) up to ``onset_tokens``, then bad ones (cycled) for
    ``tail_tokens`` more: the source turns bad once the run has read ``onset_tokens`` of it."""
    out: list[TokenDoc] = []
    for pool, budget, tag in ((healthy, onset_tokens, "h"), (bad, tail_tokens, "b")):
        got, index = 0, 0
        while got < budget:
            doc = pool[index % len(pool)]
            out.append(replace(doc, key=f"{tag}{len(out):05d}-{doc.key}"))
            got += len(doc.ids)
            index += 1
    return out


# --- writing -------------------------------------------------------------------------------------------


def write_folder(out: Path, base_tokens: Path, sources: dict[str, list[TokenDoc]]) -> None:
    """A token folder (shards, manifest, the base's tokenizers) holding ``sources``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    base = json.loads((base_tokens / "manifest.json").read_text())
    shutil.copytree(base_tokens / "tokenizers", out / "tokenizers")
    # the token shards of each source, DOCS_PER_SHARD documents each, as tokenize names them
    shards = [
        entry
        for name, docs in sources.items()
        for entry in write_token_shards(out, name, docs, DOCS_PER_SHARD)
    ]
    write_token_manifest(
        out,
        base["fingerprint"] + "-instab",
        base["tokenizers"],
        shards,
        inputs={"derived_from": str(base_tokens.resolve())},
        options=base["options"],
    )


# --- the suite's folder --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class DataPlan:
    """Where the bad sources turn bad: in tokens of that source (see ``onset_tokens``)."""

    scale: float = 0.25
    colours: int = 256
    piece: int = 128  # longest text/code document, in tokens
    # Tokens of a source read before it turns bad; the configs' weights make these steps
    # (1024 tokens a step): code_bad at 0.25 -> step 150, images_bad at 0.2 -> step 120,
    # shift_bad at 0.5 -> step 120.
    code_bad_onset: int = 38_400
    images_bad_onset: int = 24_576
    shift_bad_onset: int = 61_440
    tail: int = 400_000  # tokens of each pathology (longer than any run reads)
    vtok_steps: int = 200  # training steps of suite_tv's visual tokenizer

    def key(self) -> dict:
        return {"version": VERSION, **self.__dict__}


def held_out(docs: list[TokenDoc]) -> tuple[list[TokenDoc], list[TokenDoc]]:
    """Every document but each 10th (training), and each 10th (validation)."""
    return [doc for i, doc in enumerate(docs) if i % 10], docs[::10]


def visual_sources(tokens: Path) -> tuple[dict[str, list[TokenDoc]], list[TokenDoc]]:
    """The picture and clip sources of a token folder, and their held-out documents. Scenes and
    digits are interleaved: a source read in order then mixes its documents' kinds evenly."""
    scenes = read_source(tokens, "scenes")
    pairs = zip(scenes, read_source(tokens, "digits"))
    images, val_images = held_out([doc for pair in pairs for doc in pair])
    colours, val_colours = held_out(read_source(tokens, "colours"))
    colours_first, val_first = held_out(read_source(tokens, "colours_first"))
    sources = {
        "images": images,
        "scenes": scenes,
        "clips": read_source(tokens, "clips"),
        "docs": read_source(tokens, "docs"),
        "colours": colours,
        "colours_first": colours_first,
    }
    return sources, val_images + val_colours + val_first


def build(root: Path) -> Path:
    """The suite's token folder ``root/suite``, built once (again when ``DataPlan`` changes)."""
    plan = DataPlan()
    stamp = root / "built.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == plan.key():
        return root / "suite"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"building the suite's corpus in {root} (once)")
    base = build_base(root / "base", scale=plan.scale, colours=plan.colours)
    layout = VocabLayout.load(base / "tokenizers" / "vocab_layout.json")
    rng = np.random.default_rng(0)

    def pieces(name: str) -> list[TokenDoc]:
        """Long documents cut into pieces, the pieces shuffled (the runs read sources in stored
        order: unshuffled, one file's pieces would fill a stretch of batches)."""
        out = [
            piece_doc
            for doc in read_source(base, name)
            for piece_doc in split_long(doc, plan.piece)
        ]
        return [out[i] for i in rng.permutation(len(out))]

    code, val_code = held_out(pieces("code"))
    text, val_text = held_out(pieces("text"))
    visual, val_visual = visual_sources(base)
    del visual["scenes"]  # the untrained tokenizer's scenes are only in the images source
    images = visual["images"]
    codes = np.concatenate([doc.ids[doc.modality == int(Modality.IMAGE)] for doc in images])
    codes = codes[codes >= layout.visual_offset] - layout.visual_offset
    common = np.argsort(np.bincount(codes, minlength=layout.num_codes))[::-1][:4].tolist()
    textcode = [doc for pair in zip(text, code) for doc in pair]
    sources = {
        "code": code,
        "text": text,
        **visual,
        "val": val_code + val_text + val_visual,
        "code_bad": prefix_then(
            code,
            [garbage(doc, rng, layout) for doc in code],
            onset_tokens=plan.code_bad_onset,
            tail_tokens=plan.tail,
        ),
        "images_bad": prefix_then(
            images,
            [degenerate_codes(doc, rng, layout, common) for doc in images],
            onset_tokens=plan.images_bad_onset,
            tail_tokens=plan.tail // 4,
        ),
        "shift_bad": prefix_then(
            textcode, images, onset_tokens=plan.shift_bad_onset, tail_tokens=plan.tail
        ),
    }
    write_folder(root / "suite", base, sources)
    trained = tokenize_trained(root / "base", plan.vtok_steps)
    tv_visual, tv_val_visual = visual_sources(trained)
    tv_sources = {
        "code": code,
        "text": text,
        **tv_visual,
        "val": val_code + val_text + tv_val_visual,
    }
    write_folder(root / "suite_tv", trained, tv_sources)
    stamp.write_text(json.dumps(plan.key(), indent=1) + "\n")
    return root / "suite"
