"""``earlyfuse-prep preview``: show a few packed rows the way the model will see them.

Text: each row printed as its pieces (one per document run), text and code decoded, visual
blocks summarised as ``[image 8x8]`` / ``[video 3x8x8]``, modalities coloured when the output
is a terminal. PNG: one band per row, one cell per token coloured by modality, piece
boundaries marked, padding grey, and each image block drawn from its codes when a visual
tokenizer is at hand (it is, in the token folder's ``tokenizers/``).
"""

from __future__ import annotations

import posixpath
import shutil
import sys
from contextlib import closing
from itertools import islice
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from data.layout import parse_image, parse_video
from data.loader.config import LoaderConfig, SourceConfig
from data.loader.dataset import build_loader
from data.names import MANIFEST_FILE, TOKENIZERS_DIR, VISUAL_TOKENIZER_DIR
from data.schema import SHOWN_CONTROLS
from data.shards.storage import Folder
from data.text_tokenizer import TextTokenizer
from data.vocab import MODALITY_NAMES, Modality

COLOURS = {
    Modality.TEXT: (66, 133, 244),
    Modality.CODE: (52, 168, 83),
    Modality.IMAGE: (251, 188, 5),
    Modality.VIDEO: (234, 67, 53),
    Modality.STRUCTURE: (160, 100, 220),
}
ANSI = {
    Modality.TEXT: "34",
    Modality.CODE: "32",
    Modality.IMAGE: "33",
    Modality.VIDEO: "31",
    Modality.STRUCTURE: "35",
}
PAD = (200, 200, 200)


def sources_of(token_dir: Folder, names: list[str] | None) -> list[dict]:
    """The named sources of a token folder; without names, its training ones (not ``val/``:
    a run lists the held-out split as its validation, never among its sources)."""
    m = token_dir.read_json(MANIFEST_FILE)
    have = [s["name"] for s in m["sources"]]
    for n in names or []:
        if n not in have:
            raise ValueError(f"{token_dir}: no source {n!r} (it has {have})")
    chosen = names or [n for n in have if not n.startswith("val/")] or have
    return [{"name": n, "shards": [token_dir.child(n)]} for n in chosen]


def local_tokenizers(token_dir: Folder) -> Path:
    """The token folder's tokenizers/ as a local folder: itself, or for a remote token folder a
    copy downloaded into a temporary folder (a few MB: text tokenizer, layout, visual weights)."""
    if not token_dir.remote:
        return token_dir.local / TOKENIZERS_DIR
    import tempfile

    dest = Path(tempfile.mkdtemp(prefix="earlyfuse-tokenizers-"))
    files = token_dir.sizes(TOKENIZERS_DIR)
    if not files:
        raise ValueError(f"{token_dir.child(TOKENIZERS_DIR)}: no tokenizers there")
    for rel in files:
        token_dir.download(rel, dest / rel)
    return dest / TOKENIZERS_DIR


def config_of(path: Path) -> dict:
    """The ``data`` section of a run's config.yaml (RUN_DIR/config.yaml, resolved) or a data config
    (configs/data/*.yaml): its sources with their weights, seq_len, seed, shuffle, mix_chunk."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: cannot read it as YAML ({e})") from None
    data = raw.get("data", raw) if isinstance(raw, dict) else None
    if not isinstance(data, dict) or not data.get("sources"):
        raise ValueError(
            f"{path}: no data sources of its own (give a run's config.yaml or a data config that "
            "lists its sources; a defaults list is not followed here, Hydra resolves it)"
        )
    data.pop("defaults", None)  # Hydra follows a defaults list; preview reads the own keys
    LoaderConfig.from_dict(data, str(path))  # a key that is no loader field, named now
    return data


# The packing efficiency and the mix are measured over this many rows at least (fewer when an
# epoch's data ends first): a few rows over-state the packing, a row-sized clip filling a row alone.
MEASURED_ROWS = 256


def rows(
    token_dir: Folder,
    names: list[str] | None,
    seq_len: int,
    n_rows: int,
    seed: int,
    config: dict | None = None,
) -> tuple[list[dict], dict]:
    """``n_rows`` packed rows, and what the loader delivered over at least ``MEASURED_ROWS``
    (``delivered()`` and the sources' weights)."""
    # the run's own sources, weights and packing options, or the token folder's sources
    data = {"seed": seed, **(config or {"sources": sources_of(token_dir, names)})}
    data["sources"] = [src for src in data["sources"] if not names or src["name"] in names]
    # a dropped block is shown and counted below, not refused (allow_block_drops)
    cfg = LoaderConfig.from_dict(data, seq_len=seq_len, num_workers=0, allow_block_drops=True)
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=1)
    with closing(iter(loader)) as batches:
        out = [
            {k: v[0].numpy() if hasattr(v, "numpy") and v.dim() else v for k, v in b.items()}
            for b in islice(batches, n_rows)
        ]
        measured = len(out) + sum(1 for _ in islice(batches, max(0, MEASURED_ROWS - len(out))))
    delivered = {**loader.delivered(), "rows": measured}
    delivered["weights"] = {s.name: s.weight for s in cfg.sources}
    return out, delivered


def _runs(row: dict) -> list[tuple[int, int]]:
    """(start, end) of each piece of a row, in order (padding excluded)."""
    doc = row["doc_ids"]
    cuts = [0, *(np.flatnonzero(np.diff(doc)) + 1).tolist(), len(doc)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if row["input_ids"][a] != 0]


def describe(row: dict, tok: TextTokenizer, colour: bool) -> str:
    lay = tok.layout
    ids, mod = row["input_ids"], row["modality"]
    sid = lay.structure_id
    # a block's opening token -> (its closing token, its modality, its parser)
    blocks = {
        sid("<boi>"): (sid("<eoi>"), Modality.IMAGE, parse_image),
        sid("<bov>"): (sid("<eov>"), Modality.VIDEO, parse_video),
    }
    lines: list[str] = []
    for a, b in _runs(row):
        parts, i = [], a
        while i < b:
            m = Modality(int(mod[i]))
            j = i
            if int(ids[i]) in blocks:
                end_id, m, parse = blocks[int(ids[i])]
                j = i + int(np.flatnonzero(ids[i:b] == end_id)[0]) + 1
                shape = "x".join(map(str, parse(ids[i:j], lay).shape))
                text = f"[{m.name.lower()} {shape}]"
            else:
                while j < b and Modality(int(mod[j])) == m and ids[j] < lay.structure_offset:
                    j += 1
                j = max(j, i + 1)
                text = (
                    tok.decode(ids[i:j].tolist()).translate(SHOWN_CONTROLS)
                    if ids[i] < lay.structure_offset
                    else lay.structure[int(ids[i]) - lay.structure_offset]
                )
            parts.append(f"\x1b[{ANSI[m]}m{text}\x1b[0m" if colour else text)
            i = j
        lines.append(f"  ── piece {len(lines)} ({b - a} tokens) ──\n" + "".join(parts))
    return "\n".join(lines)


def render_png(rows_: list[dict], tok: TextTokenizer, path: Path, vtok=None) -> list[Path]:
    """The rows drawn to ``path`` and, with a visual tokenizer, the first four image or video
    blocks of each row decoded to ``PATH_images.png`` (a clip as its first and last frames side
    by side): the files written."""
    lay, cell, width = tok.layout, 5, 128
    seq = len(rows_[0]["input_ids"])
    lines = -(-seq // width)
    band = lines * cell + 8
    img = Image.new("RGB", (width * cell + 20, band * len(rows_) + 40), (255, 255, 255))
    d = ImageDraw.Draw(img)
    for k, m in enumerate(Modality):
        d.rectangle([10 + k * 90, 8, 22 + k * 90, 20], fill=COLOURS[m])
        d.text((26 + k * 90, 8), MODALITY_NAMES[k], fill=(0, 0, 0))
    for r, row in enumerate(rows_):
        y0 = 32 + r * band
        ids, mod, doc = row["input_ids"], row["modality"], row["doc_ids"]
        for i in range(seq):
            x, y = 10 + (i % width) * cell, y0 + (i // width) * cell
            c = PAD if ids[i] == 0 else COLOURS[Modality(int(mod[i]))]
            if i and doc[i] != doc[i - 1]:
                c = (0, 0, 0)  # a piece boundary
            d.rectangle([x, y, x + cell - 1, y + cell - 1], fill=c)
    img.save(path)
    written = [path]
    if vtok is not None:  # the row's first blocks, decoded from their codes, beside the bands
        import torch

        def picture(frames) -> Image.Image:  # [N, 3, H, W] in [-1, 1] -> the frames side by side
            pixels = (torch.cat(list(frames), dim=2).permute(1, 2, 0).numpy() + 1) * 127.5
            return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))

        thumbs = []
        boi, bov = lay.structure_id("<boi>"), lay.structure_id("<bov>")
        for row in rows_:
            ids = row["input_ids"]
            for s in np.flatnonzero((ids == boi) | (ids == bov))[:4]:
                end = lay.structure_id("<eoi>" if ids[s] == boi else "<eov>")
                e = s + int(np.flatnonzero(ids[s:] == end)[0]) + 1
                if ids[s] == boi:
                    codes = torch.from_numpy(parse_image(ids[s:e], lay))[None]
                    thumbs.append(picture(vtok.decode(codes)))
                else:  # a clip: its first and last frames
                    codes = torch.from_numpy(parse_video(ids[s:e], lay))[None]
                    thumbs.append(picture(vtok.decode_video(codes)[0][[0, -1]]))
        if thumbs:
            strip = Image.new(
                "RGB", (sum(t.width + 4 for t in thumbs), max(t.height for t in thumbs)), "white"
            )
            x = 0
            for t in thumbs:
                strip.paste(t, (x, 0))
                x += t.width + 4
            written.append(path.with_name(path.stem + "_images.png"))
            strip.resize((strip.width * 2, strip.height * 2), Image.Resampling.NEAREST).save(
                written[-1]
            )
    return written


def preview(
    token_dir: str | Path | None,
    *,
    sources: list[str] | None = None,
    seq_len: int | None = None,
    n_rows: int = 2,
    seed: int = 0,
    png: str | Path | None = None,
    colour: bool | None = None,
    config: str | Path | None = None,
) -> str:
    data = config_of(Path(config)) if config else None
    if token_dir is None:
        if data is None:
            raise ValueError("give a TOKEN_DIR or --config")
        token_dir = _token_dir_of(data)
    folder = Folder(token_dir)
    seq_len = seq_len or int((data or {}).get("seq_len", 2048))
    own = (data or {}).get("tokenizers")  # data.tokenizers: what the loader tokenizes with
    tokenizers = Path(own) if own else local_tokenizers(folder)
    try:
        tok = TextTokenizer.load(tokenizers)
        packed, delivered = rows(folder, sources, seq_len, n_rows, seed, data)
        colour = sys.stdout.isatty() if colour is None else colour
        out = []
        for r, row in enumerate(packed):
            counts = np.bincount(row["modality"][row["input_ids"] != 0], minlength=len(Modality))
            out.append(
                f"row {r}: {counts.sum()}/{seq_len} real tokens; "
                + ", ".join(f"{MODALITY_NAMES[i]} {c}" for i, c in enumerate(counts) if c)
            )
            out.append(describe(row, tok, colour))
        over = f"over {delivered['rows']} rows"
        out.append(f"packing efficiency {over}: {delivered['packing_efficiency']:.1%}")
        total = sum(delivered["tokens_by_source"].values()) or 1
        weights = delivered["weights"]
        wsum = sum(weights.values()) or 1.0
        out.append(
            f"tokens by source {over} (weight): "
            + ", ".join(
                f"{n} {c / total:.0%} ({weights.get(n, 0) / wsum:.0%})"
                for n, c in delivered["tokens_by_source"].items()
            )
        )
        dropped = delivered["dropped_by_source"]
        if dropped:
            out.append(
                f"DROPPED visual blocks longer than seq_len {seq_len}: "
                + "; ".join(
                    f"{n}: " + ", ".join(f"{v} {m}" for m, v in d.items() if v)
                    for n, d in dropped.items()
                )
                + " (a training run refuses such sources unless data.allow_block_drops=true; "
                f"tokenize with --seq-len {seq_len} to fit them)"
            )
        else:
            out.append("dropped visual blocks: none")
        if png:
            from data.tokenize.visual import load_visual_tokenizer

            vtok_dir = tokenizers / VISUAL_TOKENIZER_DIR
            vtok = load_visual_tokenizer(vtok_dir, tok.layout) if vtok_dir.is_dir() else None
            out.append("wrote " + " and ".join(map(str, render_png(packed, tok, Path(png), vtok))))
        return "\n".join(out)
    finally:
        if folder.remote and not own:  # the downloaded copy
            shutil.rmtree(tokenizers.parent, ignore_errors=True)


def _token_dir_of(data: dict) -> str:
    """The token folder holding the config's first source (where its manifest and tokenizers/
    are: the shard folder or one of the two above it), a path or an fsspec URL."""
    from data.loader.table_load import load_table

    first = data["sources"][0]
    table = load_table(SourceConfig(name=first["name"], shards=list(first["shards"])))
    if table.manifest_url.startswith("pipe:"):
        raise ValueError(
            f"source {first['name']}: no token folder found for {first['shards']}; give TOKEN_DIR"
        )
    return posixpath.dirname(table.manifest_url)
