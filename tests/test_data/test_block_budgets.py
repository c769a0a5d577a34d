"""Visual blocks that fit the row: photos larger than a row and phone-like videos
(portrait, odd sizes, rotation metadata, one frame, shorter than a sampling interval) go through
real ingest, real decord and real tokenize; at README defaults and seq_len 512 the loader either
delivers every image or refuses to start naming the budget; drops are counted when allowed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from factories import jpeg_bytes, mp4_bytes, rotated_mp4
from test_data.test_loader import take

from data.cli import main
from data.image_prep import ImagePrep
from data.ingest import ingest
from data.layout import image_block_len, parse_image, video_block_len
from data.loader import LoaderConfig, SourceConfig, build_loader
from data.shards.index import read_index
from data.text_tokenizer import TextTokenizer
from data.video_frames import VideoSampling, decode_frames

SEQ = 512

# name -> (mp4 bytes, displayed width, height)
VIDEOS = {
    "portrait": (lambda: mp4_bytes(frames=12, fps=8, w=180, h=320), 180, 320),
    "odd": (lambda: mp4_bytes(frames=6, fps=8, w=97, h=203, pix_fmt="yuv444p"), 97, 203),
    "rotated": (lambda: rotated_mp4(mp4_bytes(frames=8, fps=8, w=160, h=96), 90), 96, 160),
    "one_frame": (lambda: mp4_bytes(frames=1, fps=8, w=64, h=48), 64, 48),
    # two frames at 30 fps: 0.07 s, shorter than one sampling interval (0.25 s at 4 fps)
    "blink": (lambda: mp4_bytes(frames=2, fps=30, w=48, h=64), 48, 64),
    "long": (lambda: mp4_bytes(frames=64, fps=8, w=128, h=96), 128, 96),
}


@pytest.fixture(scope="module")
def phone_raw(tmp_path_factory) -> Path:
    """Raw shards of photos larger than a row (captioned) and of the videos above."""
    root = tmp_path_factory.mktemp("phone")
    photos = root / "in" / "photos"
    photos.mkdir(parents=True)
    for i, (w, h) in enumerate([(640, 480), (480, 640), (300, 300), (800, 400)]):
        (photos / f"p{i}.jpg").write_bytes(jpeg_bytes(w, h, seed=i))
        (photos / f"p{i}.txt").write_text(f"photo number {i}, {w} by {h}")
    videos = root / "in" / "videos"
    videos.mkdir()
    for name, (make, _, _) in VIDEOS.items():
        (videos / f"{name}.mp4").write_bytes(make())
        (videos / f"{name}.txt").write_text(f"a clip called {name}")
    s = ingest(root / "raw", [f"photos=images:{photos}", f"videos=videos:{videos}"])
    assert s["finalized"] and s["manifest"]["totals"]["rejects"] == 0
    return root / "raw"


def tokenize(raw: Path, out: Path, tokenizers, *extra: str) -> int:
    text, visual = tokenizers
    args = ["tokenize", "--in", str(raw), "--out", str(out), "--tokenizer", str(text)]
    return main(args + ["--visual-tokenizer", str(visual), "--no-progress", *extra])


@pytest.fixture(scope="module")
def fitted(phone_raw, tiny_tokenizers, tmp_path_factory) -> Path:
    """README defaults (--image-max-pixels 65536, video defaults) plus --seq-len 512."""
    out = tmp_path_factory.mktemp("fitted") / "tokens"
    assert tokenize(phone_raw, out, tiny_tokenizers, "--seq-len", str(SEQ)) == 0
    return out


@pytest.fixture(scope="module")
def unfitted(phone_raw, tiny_tokenizers, tmp_path_factory) -> Path:
    """README defaults alone: ~1,000-token images."""
    out = tmp_path_factory.mktemp("unfitted") / "tokens"
    assert tokenize(phone_raw, out, tiny_tokenizers) == 0
    return out


def spans(folder: Path, source: str) -> dict[str, list[dict]]:
    m = json.loads((folder / "manifest.json").read_text())
    out = {}
    for sh in m["shards"]:
        if sh["source"] == source:
            with open(folder / sh["path"], "rb") as f:
                for e in read_index(folder / sh["index"]):
                    f.seek(e["members"]["json"][0])
                    out[e["key"]] = json.loads(f.read(e["members"]["json"][1]))["spans"]
    return out


DEMO_BUDGETS = ["--image-max-pixels", "4096", "--video-max-pixels", "1024", "--video-max-tokens"]


def test_every_video_is_tokenized_at_any_aspect_and_fits_the_row(
    fitted, unfitted, phone_raw, tiny_tokenizers, tmp_path
):
    demo = tmp_path / "demo_budgets"  # make demo's flags (the 180x320 clip used to fail there)
    assert tokenize(phone_raw, demo, tiny_tokenizers, *DEMO_BUDGETS, "512", "--seq-len", "512") == 0
    for folder in (fitted, unfitted, demo):
        m = json.loads((folder / "manifest.json").read_text())
        assert m["totals"]["rejects"] == 0
        got = spans(folder, "videos")
        assert len(got) == len(VIDEOS)
        for key, sp in got.items():
            video = next(s for s in sp if s["type"] == "video")
            _, w, h = VIDEOS[next(n for n in VIDEOS if n in key.split("-", 1)[1])]
            t, gh, gw = video["grid"]
            assert (gh > gw) == (h > w), (key, video["grid"])  # shown as played, rotation applied
            assert len(video["times"]) >= 1 and video["times"][0] == 0.0  # the first frame at least
            if folder != unfitted:
                assert video["end"] - video["start"] <= SEQ
    # A clip of two latent frames or more keeps them under a tight budget: fewer frames first.
    sp = spans(fitted, "videos")
    long = next(next(s for s in v if s["type"] == "video") for k, v in sp.items() if "long" in k)
    assert long["grid"][0] >= 2
    # The summary tokenize prints says what a run's rows need.
    from data.tokenize.blocks import describe

    said = "\n".join(describe(json.loads((fitted / "manifest.json").read_text())))
    assert (
        f"every block has at most {SEQ} tokens: a run with data.seq_len >= {SEQ} drops none" in said
        and "videos: 6 video blocks" in said
    )
    said = "\n".join(describe(json.loads((unfitted / "manifest.json").read_text())))
    assert "photos: 4 image blocks, longest 1060 tokens" in said and "data.seq_len >=" in said


def test_photos_larger_than_a_row_are_downscaled_to_fit_never_dropped(fitted, unfitted):
    big = spans(unfitted, "photos")
    small = spans(fitted, "photos")
    assert big.keys() == small.keys() and len(big) == 4
    for key in big:
        b = next(s for s in big[key] if s["type"] == "image")
        s = next(s for s in small[key] if s["type"] == "image")
        assert b["end"] - b["start"] > SEQ >= s["end"] - s["start"]
        # aspect kept (to a grid cell)
        assert (b["grid"][0] >= b["grid"][1]) == (s["grid"][0] >= s["grid"][1])
    m = json.loads((fitted / "manifest.json").read_text())
    photos = next(s for s in m["sources"] if s["name"] == "photos")
    assert photos["blocks"]["image"] == {
        "blocks": 4,
        "longest": max(
            next(x for x in v if x["type"] == "image")["end"]
            - next(x for x in v if x["type"] == "image")["start"]
            for v in small.values()
        ),
        "rejected": 0,
        # how many image blocks have each grid (earlyfuse-generate --draw takes the commonest)
        "grids": dict(
            Counter(
                "{}x{}".format(*next(x for x in v if x["type"] == "image")["grid"])
                for v in small.values()
            )
        ),
    }
    assert m["options"]["max_block_tokens"] == SEQ


def loader_cfg(folder: Path, **kw) -> LoaderConfig:
    srcs = [SourceConfig(name=s, shards=[str(folder / s)]) for s in ("photos", "videos")]
    return LoaderConfig(sources=srcs, seq_len=SEQ, num_workers=0, shuffle_buffer=4, **kw)


def test_the_loader_refuses_blocks_that_would_be_dropped_naming_the_budget(unfitted):
    with pytest.raises(ValueError) as e:
        build_loader(loader_cfg(unfitted), rank=0, world_size=1, micro_batch=2)
    msg = str(e.value)
    assert "source photos: 4 of its 4 image blocks are longer than data.seq_len=512" in msg
    assert "--image-max-pixels 65536" in msg and "--seq-len 512" in msg
    # every budget the shards were made with, as tokenize's flags name them
    assert "tokenized with --image-max-pixels 65536 --video-max-pixels 16384 --video-fps" in msg
    assert "allow_block_drops" in msg
    # Accepted explicitly: every drop is counted per source and modality, batch by batch.
    ld = build_loader(
        loader_cfg(unfitted, allow_block_drops=True), rank=0, world_size=1, micro_batch=2
    )
    it = iter(ld)
    batches = [next(it) for _ in range(6)]
    it.close()
    d = ld.delivered()
    assert d["dropped_by_source"]["photos"]["image"] >= 4
    assert (
        sum(int(b["dropped_blocks"][0, 0]) for b in batches)
        == d["dropped_by_source"]["photos"]["image"]
    )


def test_fitted_photos_deliver_every_image_they_draw(fitted, tiny_tokenizers):
    """Every photo document the loader starts reaches the model with its whole image block."""
    lay = TextTokenizer.load(tiny_tokenizers[0]).layout
    boi, eoi = lay.structure_id("<boi>"), lay.structure_id("<eoi>")
    ld = build_loader(loader_cfg(fitted), rank=0, world_size=1, micro_batch=2)
    it = iter(ld)
    pieces: dict[int, list] = {}
    for _ in range(12):
        b = next(it)
        for r in range(b["input_ids"].shape[0]):
            for j, (s, sample, start, _end) in enumerate(b["pieces"][r].tolist()):
                if s == 0:
                    ids = b["input_ids"][r][b["doc_ids"][r] == j].numpy()
                    pieces.setdefault(sample, []).append((start, ids))
    it.close()
    whole = 0
    for got in pieces.values():
        ids = np.concatenate([x for _, x in sorted(got, key=lambda p: p[0])])
        if got[0][0] == 0 and (ids == eoi).any():
            at = int(np.flatnonzero(ids == boi)[0])
            parse_image(ids[at : int(np.flatnonzero(ids == eoi)[0]) + 1], lay)
            whole += 1
    assert whole >= 4 and ld.delivered()["dropped_blocks"] == 0


def test_portrait_clip_decodes_at_the_size_decord_cannot_resize_to():
    """decord's own resize gives 4 channels for 24x40 from 180x320 (the demo's budget); frames
    are decoded natively and resized here, so the shape is right."""
    raw = mp4_bytes(frames=4, fps=8, w=180, h=320)
    f = decode_frames(raw, VideoSampling(8, 8), ImagePrep(factor=8, max_pixels=1024))
    assert f.frames.shape == (4, 40, 24, 3)
    f = decode_frames(rotated_mp4(raw, 90), VideoSampling(8, 8), ImagePrep(8, 1024))
    assert f.frames.shape == (4, 24, 40, 3)  # 180x320 stored, turned a quarter: shown 320x180


def test_block_budget_shrinks_images_and_spends_frames_before_size(tiny_tokenizers):
    prep = ImagePrep(factor=8, max_pixels=256 * 256, max_grid=64, max_tokens=SEQ)
    for w, h in [(4000, 3000), (3000, 4000), (5000, 100), (64, 64)]:
        tw, th = prep.target_size(w, h)
        assert image_block_len(th // 8, tw // 8) <= SEQ
    assert prep.target_size(3000, 4000)[1] > prep.target_size(3000, 4000)[0]  # portrait stays so
    # A budget that is not binding changes nothing.
    loose = ImagePrep(8, 4096, 64, max_tokens=SEQ)
    assert loose.target_size(640, 480) == ImagePrep(8, 4096, 64).target_size(640, 480)
    # Video: a 4 s clip at 4 fps wants 16 frames (latents of 8x8 codes with the debug tokenizer,
    # factor 4); at 240 tokens it keeps 3 latents (fewer frames), at 128 tokens 2 latents of
    # smaller frames.
    import torch

    from data.tokenize.encoder import DocEncoder, TokenizeOptions
    from data.tokenize.visual import load_visual_tokenizer

    text = TextTokenizer.load(tiny_tokenizers[0])
    vtok = load_visual_tokenizer(tiny_tokenizers[1], text.layout)
    seg = {"width": 32, "height": 32, "frames": 100, "fps": 25.0, "duration": 4.0}

    def plan(**kw):
        opts = TokenizeOptions(video_max_pixels=32 * 32, **kw)
        frame_prep, frames = DocEncoder(text, vtok, opts, torch.device("cpu")).video_plan(seg)
        tw, th = frame_prep.target_size(32, 32)
        latents = 1 + -(-(frames - 1) // vtok.cfg.temporal_factor)
        return latents, th // vtok.cfg.factor, tw // vtok.cfg.factor

    assert plan() == (1 + -(-15 // vtok.cfg.temporal_factor), 8, 8)  # all 16 frames fit
    assert plan(max_block_tokens=240) == (3, 8, 8)  # fewer frames, same size
    lat, h, w = plan(max_block_tokens=128)
    assert lat == 2 and h * w < 64 and video_block_len(lat, h, w) <= 128
    assert plan(max_block_tokens=8)[0] == 1  # not even two 1x1 latents: one frame


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory) -> Path:
    """Raw shards of one document: the 8 s clip (64 frames at 8 fps, a real mp4) with a caption,
    long enough that the document outgrows a row of 512 when only its block is fitted to it."""
    root = tmp_path_factory.mktemp("long_clip")
    videos = root / "in" / "videos"
    videos.mkdir(parents=True)
    (videos / "long.mp4").write_bytes(VIDEOS["long"][0]())
    (videos / "long.txt").write_text("a clip called long, " * 6)
    assert ingest(root / "raw", [f"videos=videos:{videos}"])["finalized"]
    return root / "raw"


FAST = ["--video-max-pixels", "1024"]  # 32x32 frames: the clip's block stays quick to encode


def test_doc_budget_keeps_a_long_clip_long_and_bounds_the_whole_document(
    long_clip, tiny_tokenizers, tmp_path
):
    """`--doc-budget`: the 8 s clip (64 frames at 8 fps, a real mp4 through decord) tokenized for
    rows of 512 keeps few latent frames; for a long stage's rows of 4096 it keeps every frame its
    sampling yields; `--seq-len 512` alone bounds the
    block, not its document (the caption makes it longer than the row), and with `--doc-budget
    512` the whole document fits; and a budget its caption alone
    fills is a reject that says so, never a silent cut."""

    def tokenized(name: str, *flags: str) -> tuple[int, int, Path]:
        out = tmp_path / name
        code = tokenize(long_clip, out, tiny_tokenizers, *FAST, *flags)
        doc = next(iter(spans(out, "videos").values()), None) if code == 0 else None
        return (doc[-1]["end"] + 1 if doc else 0), code, out  # <|eos|> after the last span

    def video_of(out: Path) -> dict:
        return next(s for s in next(iter(spans(out, "videos").values())) if s["type"] == "video")

    short_len, _, short = tokenized("short", "--seq-len", "512")
    long_len, _, long = tokenized("long", "--seq-len", "4096", "--doc-budget", "4096")
    assert video_of(short)["grid"][0] < video_of(long)["grid"][0]
    assert len(video_of(long)["times"]) == 32  # 8 s at 4 fps: every sampled frame kept
    assert len(video_of(short)["times"]) < 32
    assert 512 < long_len <= 4096
    # --seq-len bounds the block alone: with its caption the document outgrows the row.
    assert video_of(short)["end"] - video_of(short)["start"] <= 512 < short_len
    whole_len, _, whole = tokenized("whole", "--seq-len", "512", "--doc-budget", "512")
    assert whole_len <= 512 and video_of(whole)["grid"][0] >= 2
    manifest = json.loads((whole / "manifest.json").read_text())
    assert manifest["options"]["doc_budget"] == 512
    _, code, over = tokenized("over", "--doc-budget", "40")
    rejects = (over / "rejects.jsonl").read_text()
    assert code != 0 and "over-doc-budget" in rejects and "--doc-budget 40" in rejects


def test_the_loader_gives_a_raw_clip_the_tokens_of_tokenize_doc_budget(
    long_clip, tiny_tokenizers, tmp_path
):
    """`data.doc_budget` on a raw source tokenized by the loader: without it the clip's block
    alone is fitted to the row and its caption pushes the document past the row, which is split;
    with it the document fits the row whole, id for id what `tokenize --seq-len 512 --doc-budget
    512` gives it. The budget is part of the loader state's fingerprint: a state saved with it
    does not resume without it."""
    from data.loader.config import OnlineTokenizeConfig
    from data.token_docs import iter_documents, source_tables

    offline = tmp_path / "tokens"
    flags = ["--seq-len", str(SEQ), "--doc-budget", str(SEQ)]
    assert tokenize(long_clip, offline, tiny_tokenizers, *FAST, *flags) == 0
    (want,) = iter_documents(source_tables(offline))
    assert len(want.ids) <= SEQ

    def loader(**budget):
        cfg = LoaderConfig(
            sources=[SourceConfig(name="videos", shards=[str(long_clip / "videos")])],
            seq_len=SEQ,
            num_workers=0,
            whole_documents=True,  # the next epoch's copy of the clip starts a row of its own
            tokenizers=str(offline / "tokenizers"),
            tokenize=OnlineTokenizeConfig(video_max_pixels=1024),
            **budget,
        )
        return build_loader(cfg, rank=0, world_size=1, micro_batch=1)

    def first_stretch(batch) -> np.ndarray:
        doc_ids = batch["doc_ids"][0].numpy()
        return batch["input_ids"][0].numpy()[doc_ids == doc_ids[0]]

    budgeted = loader(doc_budget=SEQ)
    (batch,) = take(budgeted, 1)
    np.testing.assert_array_equal(first_stretch(batch), want.ids)  # whole, tokenize's ids
    # Without the budget the clip keeps more frames: the document is longer than the row.
    unbounded = loader()
    (batch,) = take(unbounded, 1)
    assert len(first_stretch(batch)) == SEQ
    assert unbounded.delivered()["errors"] == 0
    with pytest.raises(ValueError, match="data.doc_budget; fingerprint"):
        unbounded.load_state_dict(budgeted.state_dict())
    with pytest.raises(ValueError, match="data.doc_budget 4: a visual block needs at least 8"):
        loader(doc_budget=4)
