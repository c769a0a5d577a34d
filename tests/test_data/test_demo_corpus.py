"""The offline demo corpus: layout, determinism, and checkable captions.

One small build (scale 0.1) is shared by the module; a second build with the same seed must
be byte-identical. Clips are decoded from bytes with decord, as the loader will.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import pathlib
import tarfile

import numpy as np
import pytest
from PIL import Image

from data.demo_corpus import build, caption_facts, check_clip, check_scene
from data.demo_corpus import scenes as scenes_mod
from data.demo_corpus._common import scaled
from data.demo_corpus.photos import available
from data.demo_corpus.scene_scoring import score_caption

decord = pytest.importorskip("decord")
pytest.importorskip("av")

SCALE = 0.1
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up", "in": "out", "out": "in"}


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _digest(root: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "corpus"
    return out, build(out, seed=0, scale=SCALE, progress=False)


def _pixels(source) -> np.ndarray:
    with Image.open(source) as image:
        return np.asarray(image)


def _decode(path: pathlib.Path) -> np.ndarray:
    vr = decord.VideoReader(io.BytesIO(path.read_bytes()))
    return vr.get_batch(list(range(len(vr)))).asnumpy()


# ---------------------------------------------------------------- layout


def test_layout_and_summary(corpus):
    out, summary = corpus
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "clips",
        "code",
        "digits",
        "interleaved",
        "photos",
        "scenes",
        "text",
        "wds",
    ]
    assert (out / "README.md").read_text().startswith("# earlyfuse demo corpus")
    files = [p for p in out.rglob("*") if p.is_file()]
    assert summary["files"] == len(files)
    assert summary["bytes"] == sum(p.stat().st_size for p in files)
    assert not list(out.parent.glob(".*partial*")), "staging folder left behind"

    code = sorted((out / "code").rglob("*.py"))
    assert len(code) == summary["parts"]["code"]["files"] == 15
    for p in code:
        rel = p.relative_to(out / "code")
        assert not {"test", "tests", "idlelib", "site-packages"} & set(rel.parts)
        assert p.stat().st_size <= 60_000
        p.read_bytes().decode("utf-8")

    for name in ("pydoc_topics.jsonl", "docstrings.jsonl"):
        rows = _jsonl(out / "text" / name)
        assert rows and all(set(r) == {"id", "text"} and r["text"] for r in rows)
    assert all(len(r["text"]) > 200 for r in _jsonl(out / "text" / "docstrings.jsonl"))


def test_photos_are_original_bytes_with_captions(corpus):
    out, summary = corpus
    shipped = available()
    assert len(shipped) >= 10 and summary["parts"]["photos"]["images"] == len(shipped)
    names = {p.file for p, _ in shipped}
    assert {"astronaut.png", "chelsea.png", "china.jpg", "flower.jpg"} <= names
    for photo, src in shipped:
        assert (out / "photos" / photo.file).read_bytes() == src.read_bytes()
        assert (out / "photos" / photo.file).with_suffix(
            ".txt"
        ).read_text().strip() == photo.caption
    assert sorted(p.suffix for p in (out / "photos").iterdir()) and all(
        p.suffix in (".png", ".jpg", ".txt") for p in (out / "photos").iterdir()
    )


def test_digits(corpus):
    out, _ = corpus
    with open(out / "digits" / "digits.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 30 and list(rows[0]) == ["image", "caption", "label"]
    for r in rows:
        assert r["caption"] == f"a handwritten digit {r['label']}" and 0 <= int(r["label"]) <= 9
        assert _pixels(out / "digits" / r["image"]).shape == (32, 32)  # greyscale 32x32


def test_interleaved_documents(corpus):
    out, _ = corpus
    docs = _jsonl(out / "interleaved" / "docs.jsonl")
    assert len(docs) == 8
    native = [d for d in docs if "segments" in d]
    obelics = [d for d in docs if "texts" in d]
    assert native and obelics and len(native) + len(obelics) == len(docs)
    base = out / "interleaved"
    for d in obelics:
        assert len(d["texts"]) == len(d["images"])
        assert all((t is None) != (i is None) for t, i in zip(d["texts"], d["images"]))
        assert any(i for i in d["images"]) and any(t for t in d["texts"])
        for i in filter(None, d["images"]):
            assert i.startswith(("../scenes/img/", "../photos/")) and (base / i).is_file()
    for d in native:
        for s in d["segments"]:
            assert s["type"] in ("text", "image", "video")
            if s["type"] != "text":
                assert (base / s["path"]).is_file()
    assert any(s["type"] == "video" for d in native for s in d["segments"])


def test_wds_shard_is_img2dataset_style_and_deterministic(corpus):
    out, _ = corpus
    with tarfile.open(out / "wds" / "00000.tar") as tar:
        members = tar.getmembers()
        assert len(members) == 3 * 5
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (946684800, 0, 0, "", "")
        keys = sorted({m.name.split(".")[0] for m in members})
        assert all(len(k) == 9 and k.isdigit() for k in keys)
        for k in keys:
            meta = json.loads(tar.extractfile(f"{k}.json").read())
            assert meta["key"] == k
            assert meta["caption"] == tar.extractfile(f"{k}.txt").read().decode()
            with Image.open(tar.extractfile(f"{k}.jpg")) as jpg:
                assert jpg.format == "JPEG"
            caption_facts(meta["caption"])  # a real scene caption


# ---------------------------------------------------------------- determinism


def test_same_seed_gives_identical_bytes(corpus, tmp_path):
    out, _ = corpus
    again = build(tmp_path / "again", seed=0, scale=SCALE, progress=False)
    assert again["bytes"] == corpus[1]["bytes"]
    assert _digest(tmp_path / "again") == _digest(out)
    # ... and another seed gives other generated content.
    build(tmp_path / "other", seed=1, scale=SCALE, progress=False)
    assert (tmp_path / "other/scenes/scenes.jsonl").read_bytes() != (
        out / "scenes/scenes.jsonl"
    ).read_bytes()


def test_rebuild_replaces_a_corpus_but_refuses_a_foreign_folder(tmp_path):
    out = tmp_path / "c"
    build(out, seed=0, scale=0.1, progress=False)
    build(out, seed=0, scale=0.02, progress=False)  # smaller: the old extra files must go
    # the smaller build's scenes and as many drawings: nothing left of the bigger build
    n_scenes = scaled(scenes_mod.TARGET, 0.02, 4)
    assert len(list((out / "scenes" / "img").glob("scene_*.png"))) == n_scenes
    assert len(list((out / "scenes" / "img").iterdir())) == 2 * n_scenes
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build(foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- checkable scene captions


def test_palette_is_separable():
    colours = list(scenes_mod.PALETTE.values())
    for i, a in enumerate(colours):
        for b in colours[i + 1 :]:
            assert max(abs(x - y) for x, y in zip(a, b)) > 2 * scenes_mod.TOL
        for level in scenes_mod.BACKGROUNDS.values():
            for grey in (level - scenes_mod.NOISE, level + scenes_mod.NOISE):
                assert max(abs(x - grey) for x in a) > scenes_mod.TOL


def test_check_scene_accepts_every_generated_scene(corpus):
    out, _ = corpus
    rows = _jsonl(out / "scenes" / "scenes.jsonl")
    assert len(rows) == scaled(scenes_mod.TARGET, SCALE, 4)
    sizes = set()
    for r in rows:
        image = _pixels(out / "scenes" / r["image"])
        sizes.add(image.shape[:2])
        assert image.shape[:2] == (r["facts"]["height"], r["facts"]["width"])
        assert 1 <= len(r["facts"]["shapes"]) <= 2
        assert check_scene(image, r["facts"])
        assert check_scene(image, caption_facts(r["caption"]))  # from the caption text alone
    assert sizes == {(height, width) for width, height in scenes_mod.SIZES}
    # drawings (caption then picture) name one shape each, and their pictures show it
    for r in _jsonl(out / "scenes" / "drawings.jsonl"):
        assert len(r["facts"]["shapes"]) == 1
        assert check_scene(_pixels(out / "scenes" / r["image"]), caption_facts(r["caption"]))


def _scene_edits(facts: dict) -> list[dict]:
    """Each edit makes the facts false about the picture."""
    edits = []
    first = facts["shapes"][0]
    used_cells = {s["position"] for s in facts["shapes"]}
    other_colour = next(c for c in scenes_mod.PALETTE if c != first["colour"])
    other_shape = next(s for s in scenes_mod.SHAPES if s != first["shape"])
    other_cell = next(p for p in scenes_mod.POSITIONS if p not in used_cells)
    for key, value in (("colour", other_colour), ("shape", other_shape), ("position", other_cell)):
        f = copy.deepcopy(facts)
        f["shapes"][0][key] = value
        f["shapes"][0].pop("bbox", None)
        edits.append(f)
    f = copy.deepcopy(facts)  # an extra shape that is not there
    f["shapes"].append({"shape": "circle", "colour": "red", "position": other_cell})
    edits.append(f)
    f = copy.deepcopy(facts)  # the wrong background
    f["background"]["colour"] = next(
        c for c in scenes_mod.BACKGROUNDS if c != facts["background"]["colour"]
    )
    edits.append(f)
    if len(facts["shapes"]) > 1:  # a shape left out (only wrong when the check is exhaustive)
        f = copy.deepcopy(facts)
        f["shapes"].pop()
        edits.append(f)
    return edits


def test_check_scene_rejects_altered_facts(corpus):
    out, _ = corpus
    for r in _jsonl(out / "scenes" / "scenes.jsonl")[:15]:
        image = _pixels(out / "scenes" / r["image"])
        for edit in _scene_edits(r["facts"]):
            assert not check_scene(image, edit), (r["caption"], edit)


def test_check_scene_rejects_an_altered_caption(corpus):
    out, _ = corpus
    r = _jsonl(out / "scenes" / "scenes.jsonl")[0]
    image = _pixels(out / "scenes" / r["image"])
    colour = r["facts"]["shapes"][0]["colour"]
    swapped = "blue" if colour != "blue" else "red"
    altered = r["caption"].replace(f" {colour} ", f" {swapped} ", 1)
    assert altered != r["caption"] and not check_scene(image, caption_facts(altered))
    with pytest.raises(ValueError):
        caption_facts("a mauve hexagon somewhere, on a plain grey background")


def test_a_generated_caption_is_scored_against_a_scenes_facts():
    """The held-out evaluation's caption score: the caption is parsed back into facts and
    compared per attribute, as a drawing is; one that does not parse is wrong on every one."""
    facts = caption_facts("a red circle in the top left, on a plain grey background")
    right = "a red circle in the top left, on a noisy grey background. "
    assert score_caption(right, facts) == dict.fromkeys(
        ("colour", "shape", "position", "all"), True
    )
    wrong_cell = "a red circle in the top right, on a plain grey background"
    assert score_caption(wrong_cell, facts) == {
        "colour": True,
        "shape": True,
        "position": False,
        "all": False,
    }
    unparsed = score_caption("a red circle", facts)
    assert not any(unparsed.values()) and set(unparsed) == {"colour", "shape", "position", "all"}


# ---------------------------------------------------------------- checkable clip captions


def test_every_clip_decodes_from_bytes_and_its_caption_checks(corpus):
    out, _ = corpus
    rows = _jsonl(out / "clips" / "captions.jsonl")
    assert len(rows) == 6
    assert {r["facts"]["kind"] for r in rows} == {"motion", "pan", "zoom"}
    assert {r["facts"]["fps"] for r in rows} == {5, 8, 12, 24}
    for r in rows:
        facts = r["facts"]
        frames = _decode(out / "clips" / r["file"])
        assert frames.shape == (facts["frames"], facts["height"], facts["width"], 3)
        assert 0.5 <= facts["duration"] <= 2.0 + 1e-9
        vr = decord.VideoReader(io.BytesIO((out / "clips" / r["file"]).read_bytes()))
        assert round(vr.get_avg_fps()) == facts["fps"]
        assert check_clip(frames, facts), r["caption"]
        reversed_ = dict(facts, direction=OPPOSITE[facts["direction"]])
        assert not check_clip(frames, reversed_), r["caption"]
        if facts["kind"] in ("pan", "zoom"):
            assert (out / "clips" / facts["photo"]).is_file()


def test_check_clip_rejects_a_wrong_colour_or_direction(corpus):
    out, _ = corpus
    motion = [r for r in _jsonl(out / "clips" / "captions.jsonl") if r["facts"]["kind"] == "motion"]
    assert motion
    for r in motion:
        frames = _decode(out / "clips" / r["file"])
        facts = r["facts"]
        other = next(c for c in scenes_mod.PALETTE if c != facts["colour"])
        assert not check_clip(frames, dict(facts, colour=other))
        sideways = {"left": "up", "right": "down", "up": "left", "down": "right"}[
            facts["direction"]
        ]
        assert not check_clip(frames, dict(facts, direction=sideways))
        assert not check_clip(frames[::-1], facts)  # played backwards
