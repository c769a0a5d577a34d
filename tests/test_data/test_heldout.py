"""Held-out data that is held out: the demo corpus's train and heldout splits share no
real material, and `ingest --exclude-content-of TRAIN_RAW` rejects every document, media file or
long text that the training shards already hold, naming where it is."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil

import pytest

from data.cli import main as prep_main
from data.demo_corpus import build
from data.ingest import ingest
from data.shards.content import folder_fingerprints

pytest.importorskip("av")
SCALE = 0.05


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _file_hashes(root: pathlib.Path, folders: tuple[str, ...]) -> set[str]:
    return {
        hashlib.sha256(p.read_bytes()).hexdigest()
        for f in folders
        for p in (root / f).rglob("*")
        if p.is_file() and p.suffix in (".py", ".png", ".jpg", ".mp4")
    }


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    root = tmp_path_factory.mktemp("splits")
    build(root / "train", seed=0, scale=SCALE, split="train", progress=False)
    build(root / "heldout", seed=1, scale=SCALE, split="heldout", progress=False)
    return root / "train", root / "heldout"


def test_train_and_heldout_splits_share_no_material(splits):
    train, held = splits
    # Files: modules, photos, digits, scenes, clips (byte-identical files would be shared content).
    parts = ("code", "photos", "digits", "scenes", "clips")
    assert not _file_hashes(train, parts) & _file_hashes(held, parts)
    # Modules by path, photos by name, help topics and docstrings by id.
    assert not {p.name for p in (train / "photos").glob("*.*")} & {
        p.name for p in (held / "photos").glob("*.*")
    }
    assert list((held / "photos").glob("*.png")) or list((held / "photos").glob("*.jpg"))
    for name in ("pydoc_topics.jsonl", "docstrings.jsonl"):
        ids = [{r["id"] for r in _jsonl(c / "text" / name)} for c in (train, held)]
        assert ids[0] and ids[1] and not ids[0] & ids[1], name
    rel = [{str(p.relative_to(c / "code")) for p in (c / "code").rglob("*.py")} for c in splits]
    assert rel[0] and rel[1] and not rel[0] & rel[1]
    # A held-out pan or zoom only ever shows a held-out photo.
    photos = {f"../photos/{p.name}" for p in (held / "photos").iterdir()}
    for clip in _jsonl(held / "clips" / "captions.jsonl"):
        assert clip["facts"].get("photo", next(iter(photos))) in photos
    readme = (held / "README.md").read_text()
    assert "split heldout" in readme


def test_ingest_of_the_heldout_split_excluding_training_rejects_nothing(splits, tmp_path):
    train, held = splits

    def sources(c):
        return [
            f"code:{c / 'code'}",
            f"text:{c / 'text'}",
            f"images:{c / 'photos'}",
            f"images:{c / 'scenes' / 'scenes.jsonl'}",
            f"images:{c / 'digits' / 'digits.csv'}",
        ]

    ingest(tmp_path / "train_raw", sources(train), shard_max_samples=64)
    s = ingest(
        tmp_path / "val_raw",
        sources(held),
        shard_max_samples=64,
        exclude_content_of=[tmp_path / "train_raw"],
    )
    assert s["finalized"] and s["manifest"]["totals"]["rejects"] == 0
    a, b = folder_fingerprints(tmp_path / "train_raw"), folder_fingerprints(tmp_path / "val_raw")
    assert a and b and not set(a) & set(b)
    # Every index line carries the content fingerprints (no need to reread the documents).
    line = json.loads(next((tmp_path / "val_raw").rglob("*.idx.jsonl")).read_text().splitlines()[0])
    assert line["content"][0].startswith("d:")


def test_exclude_content_of_rejects_shared_documents_media_and_texts(splits, tmp_path, capsys):
    train, _ = splits
    ingest(
        tmp_path / "train_raw",
        [f"images:{train / 'photos'}", f"text:{train / 'text'}"],
        shard_max_samples=64,
    )
    # A "held-out" set that repeats training material three ways: the same photos and captions
    # (whole documents), one photo under another name with another caption (a media file), and
    # a docstring as one segment of a longer page (a long text segment).
    held = tmp_path / "held"
    shutil.copytree(train / "photos", held / "photos")
    photo = sorted((held / "photos").glob("*.png"))[0]
    (held / "renamed").mkdir()
    shutil.copy(photo, held / "renamed" / "other_name.png")
    (held / "renamed" / "other_name.txt").write_text("a caption never used in training\n")
    doc = _jsonl(train / "text" / "docstrings.jsonl")[0]
    (held / "notes").mkdir()
    page = {"segments": [{"type": "text", "text": "A page quoting a module:"}]}
    page["segments"].append({"type": "text", "text": doc["text"]})
    (held / "notes" / "page.jsonl").write_text(json.dumps(page) + "\n")
    (held / "fresh").mkdir()
    (held / "fresh" / "fresh.txt").write_text("Text that appears nowhere in training. " * 3)
    code = prep_main(
        [
            "ingest",
            "--out",
            str(tmp_path / "val_raw"),
            "--source",
            f"images:{held / 'photos'}",
            "--source",
            f"renamed=images:{held / 'renamed'}",
            "--source",
            f"notes=interleaved:{held / 'notes' / 'page.jsonl'}",
            "--source",
            f"fresh=text:{held / 'fresh'}",
            "--exclude-content-of",
            str(tmp_path / "train_raw"),
            "--no-progress",
        ]
    )
    assert code == 0  # done; the rejects repeat training documents, so nothing is lost
    rejects = _jsonl(tmp_path / "val_raw" / "rejects.jsonl")
    n_photos = len(list((train / "photos").glob("*.*"))) // 2  # image + caption sidecar
    assert len(rejects) == n_photos + 2
    assert {r["reason"] for r in rejects} == {"duplicate-of-excluded"}
    details = " ".join(r["detail"] for r in rejects)
    assert "whole document" in details and "a media member" in details
    assert "a text segment" in details and str(tmp_path / "train_raw") in details
    m = json.loads((tmp_path / "val_raw" / "manifest.json").read_text())
    assert m["totals"]["samples"] == 1  # only the fresh text remains
    assert "duplicate-of-excluded" in capsys.readouterr().out


def test_a_raw_index_without_content_fingerprints_is_refused(splits, tmp_path):
    """Ingest writes every document's fingerprints into its index line; an index without them
    was not written by ingest, and excluding against it would compare nothing."""
    train, _ = splits
    ingest(tmp_path / "raw", [f"text:{train / 'text'}"], shard_max_samples=64)
    index = sorted((tmp_path / "raw").rglob("*.jsonl"))
    index = [path for path in index if path.name != "rejects.jsonl"][0]
    lines = [
        {key: value for key, value in line.items() if key != "content"} for line in _jsonl(index)
    ]
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=rf"{index.name}: .* has no content fingerprints"):
        folder_fingerprints(tmp_path / "raw")
