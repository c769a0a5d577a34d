"""What a user acts on is said, on real shards: images the visual tokenizer skips for being
smaller than its crop (how many, which sources, what to do) and a held-out set too small to
measure it, and documents a full pool leaves unread; the file behind a decoder warning
such as Pillow's "Corrupt EXIF data"; exact duplicate documents, counted by `stats` and left out
by `ingest --dedupe` (listed as `duplicate` rejects); a validation split too small to measure a
source."""

from __future__ import annotations

import io
import json
import re
import warnings

from factories import png_solid
from PIL import Image

from data.cli import main as prep_main
from data.cli.ingest import thin_validation
from data.image_crops import load_pool
from data.image_prep import ImagePrep
from data.ingest import ingest
from data.ingest.plan import MIN_VAL_DOCS
from data.shards.stats import collect_stats, format_stats
from data.shards.verify import verify

# A JPEG whose EXIF block claims an entry longer than the block: Pillow warns "Corrupt EXIF data"
# when it reads the EXIF (to orient the image), without saying which file it was reading.
BAD_EXIF = b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x05\x00\x0f\x01\x02\x00\xff\xff\x00\x00"


def pool_of(raw, *, max_pixels=64 * 64, crop=32, fraction=0.0, limit=100):
    """The visual tokenizer's image pool of a raw shard folder, images only."""
    return load_pool(
        [str(raw)],
        sources=None,
        prep=ImagePrep(factor=4, max_pixels=max_pixels, max_grid=64),
        crop=crop,
        heldout_fraction=fraction,
        video_frames=False,
        limit=limit,
    )


def corrupt_exif_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(buf, "JPEG", exif=BAD_EXIF)
    return buf.getvalue()


def image_folder(root, sizes: dict[str, int]):
    root.mkdir(parents=True)
    for name, side in sizes.items():
        (root / f"{name}.png").write_bytes(png_solid(side, side, (10 * side % 255, 90, 200)))
        (root / f"{name}.txt").write_text(f"a {side} pixel square called {name}")
    return root


def test_images_smaller_than_the_crop_are_counted_by_source_with_what_to_do(tmp_path):
    icons = image_folder(tmp_path / "icons", {"i1": 16, "i2": 24, "i3": 20})
    photos = image_folder(tmp_path / "photos", {"p1": 64, "p2": 96})
    raw = tmp_path / "raw"
    assert ingest(raw, [f"icons=images:{icons}", f"photos=images:{photos}"])["finalized"]
    pool = pool_of(raw, max_pixels=128 * 128)
    assert len(pool.train) == 2 and pool.skipped == 3
    assert pool.skipped_by_source["icons"]["small"] == 3 and "photos" not in pool.skipped_by_source
    said = pool.describe_skipped(32)
    assert said.startswith("3 image(s) or frame(s) skipped, smaller than the 32x32 crop")
    assert "icons: 3 small (e.g. " in said and "(16x16)" in said
    assert "lower vtok_data.crop" in said and "vtok_data.sources" in said


def test_too_few_held_out_documents_are_warned_about_with_what_to_do(tmp_path):
    photos = image_folder(tmp_path / "photos", {f"p{index}": 40 for index in range(12)})
    raw = tmp_path / "raw"
    assert ingest(raw, [f"photos=images:{photos}"])["finalized"]

    def pool(fraction):
        return pool_of(raw, fraction=fraction)

    # None held out: the evaluation falls back to training crops, which must be said.
    said = pool(0.0).describe_heldout(0.0)
    assert said.startswith("0 document(s) held out (vtok_data.heldout_fraction 0, fewer than 5)")
    assert "measured on training crops" in said and "Raise vtok_data.heldout_fraction" in said
    few = pool(0.2)
    assert 0 < few.heldout_docs == len(few.heldout) < 5, few.heldout_docs  # 12 photos, 20 %
    assert f"rest on their {len(few.heldout)} image(s) or frame(s) alone" in few.describe_heldout(
        0.2
    )
    assert pool(0.5).describe_heldout(0.5) == ""  # 7 of 12


def test_documents_left_unread_by_a_full_pool_are_counted_by_source(tmp_path):
    icons = image_folder(tmp_path / "icons", {"i1": 16})
    photos = image_folder(tmp_path / "photos", {f"p{index}": 40 for index in range(5)})
    raw = tmp_path / "raw"
    assert ingest(raw, [f"icons=images:{icons}", f"photos=images:{photos}"])["finalized"]
    pool = pool_of(raw, limit=2)
    assert len(pool.train) == 2 and pool.not_read == {"photos": 3}
    said = pool.describe_not_read(2)
    assert said.startswith("vtok_data.cache_images 2 reached: 3 image(s) or video(s) were not")
    assert "(photos 3)" in said and "Raise vtok_data.cache_images" in said
    assert pool_of(raw).describe_not_read(100) == ""


def test_the_visual_tokenizer_leaves_ingests_held_out_split_alone(tmp_path):
    """`vtok_data.raw=[shards/]` on an ingest with --val-fraction: the val/ sources are the LM's
    held-out documents, skipped as the text tokenizer skips them, unless named in sources."""
    photos = image_folder(tmp_path / "photos", {f"p{index}": 40 for index in range(40)})
    raw = tmp_path / "raw"
    assert ingest(raw, [f"photos=images:{photos}"], val_fraction=0.25)["finalized"]
    held = json.loads((raw / "manifest.json").read_text())["sources"]
    held = next(x["samples"] for x in held if x["name"] == "val/photos")
    assert 0 < held < 40
    assert len(pool_of(raw).train) == 40 - held
    named = load_pool(
        [str(raw)],
        sources=["val/photos"],
        prep=ImagePrep(factor=4, max_pixels=64 * 64, max_grid=64),
        crop=32,
        heldout_fraction=0.0,
        video_frames=False,
        limit=100,
    )
    assert len(named.train) == held


def test_a_decoder_warning_names_the_file_at_ingest_and_when_decoding_shards(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "IMG_0042.jpg").write_bytes(corrupt_exif_jpeg())
    (photos / "IMG_0042.txt").write_text("a red rectangle")
    raw = tmp_path / "raw"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ingest(raw, [f"images:{photos}"])["finalized"]  # one worker: in this process
    said = [str(w.message) for w in caught if "Corrupt EXIF" in str(w.message)]
    assert said and all("IMG_0042.jpg: Corrupt EXIF data" in line for line in said), said

    # The visual tokenizer's pool (and tokenize) name the shard, the key and the original file.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool_of(raw, crop=16, limit=10)
    said = [str(w.message) for w in caught if "Corrupt EXIF" in str(w.message)]
    assert said and all(".tar:" in line and "(from IMG_0042.jpg)" in line for line in said), said


def text_folder(root, texts: dict[str, str]):
    root.mkdir(parents=True)
    for name, text in texts.items():
        (root / f"{name}.txt").write_text(text)
    return root


TEXTS = {
    "a": "the same note, kept twice",
    "b": "another note entirely",
    "c": "the same note, kept twice",
    "d": "the same note, kept twice",
}


def test_stats_counts_exact_duplicates(tmp_path):
    notes = text_folder(tmp_path / "notes", TEXTS)
    raw = tmp_path / "raw"
    assert ingest(raw, [f"text:{notes}"])["finalized"]
    stats = collect_stats(raw)
    assert stats["samples"] == 4 and stats["duplicates"]["documents"] == 2
    assert "notes:notes-c_txt = notes:notes-a_txt" in stats["duplicates"]["examples"]
    assert "exact duplicates: 2 document(s) repeat an earlier one" in format_stats(stats)


def test_ingest_dedupe_leaves_duplicates_out_and_lists_them(tmp_path, capsys):
    notes = text_folder(tmp_path / "notes", TEXTS)
    raw = tmp_path / "raw"
    argv = ["ingest", "--out", str(raw), "--source", f"text:{notes}", "--dedupe", "--no-progress"]
    assert prep_main(argv) == 0  # done; duplicates left out as asked lose nothing
    assert "rejected 2 input(s)" in capsys.readouterr().out
    totals = json.loads((raw / "manifest.json").read_text())["totals"]
    assert totals["samples"] == 2 and totals["rejects_by_reason"] == {"duplicate": 2}
    rejects = [json.loads(line) for line in (raw / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["key"]) for r in rejects] == [
        ("duplicate", "notes-c_txt"),
        ("duplicate", "notes-d_txt"),
    ]
    assert all("the same content as a.txt in notes (--dedupe" in r["detail"] for r in rejects)
    assert collect_stats(raw)["samples"] == 2 and collect_stats(raw)["duplicates"]["documents"] == 0
    assert verify(raw)["ok"], verify(raw)["problems"]
    shards = {tar: tar.stat().st_mtime_ns for tar in raw.rglob("*.tar")}
    assert prep_main(argv) == 0  # a rerun finds everything done and changes nothing
    assert {tar: tar.stat().st_mtime_ns for tar in raw.rglob("*.tar")} == shards
    again = [json.loads(line) for line in (raw / "rejects.jsonl").read_text().splitlines()]
    assert again == rejects and verify(raw)["ok"]


def test_a_duplicate_row_of_a_table_is_named_by_its_line_or_row(tmp_path):
    """A repeated JSONL line or parquet row is a reject naming that line or row, as the table's
    other rejects are: it named the whole table, leaving the user to find the copy."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = [{"text": "once"}, {"text": "twice"}, {"text": "once"}]
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    red, blue = png_solid(8, 8, (200, 0, 0)), png_solid(8, 8, (0, 0, 200))
    pq.write_table(
        pa.table({"image": [red, blue, red], "caption": ["a red square"] * 3}),
        tmp_path / "pics.parquet",
    )
    (tmp_path / "a.png").write_bytes(blue)
    (tmp_path / "b.png").write_bytes(blue)
    (tmp_path / "caps.csv").write_text("file,caption\na.png,blue\nb.png,blue\n")
    raw = tmp_path / "raw"
    sources = [f"notes=text:{tmp_path / 'notes.jsonl'}", f"pics=images:{tmp_path / 'pics.parquet'}"]
    ingest(raw, [*sources, f"caps=images:{tmp_path / 'caps.csv'}"], dedupe=True)
    rejects = [json.loads(line) for line in (raw / "rejects.jsonl").read_text().splitlines()]
    assert {(r["reason"], r["path"]) for r in rejects} == {
        ("duplicate", "notes.jsonl:3"),
        ("duplicate", "pics.parquet:row 2"),
        ("duplicate", "caps.csv:3 (b.png)"),
    }


def test_dedupe_keeps_the_training_copy_of_a_held_out_duplicate(tmp_path):
    # Two copies, the first (in listing order) held out by its key's hash, the second not: the
    # training copy is kept, whatever the order.
    from data.ingest.plan import in_validation

    def held_out(name: str) -> bool:
        return in_validation(f"notes-{name}_txt", 0.5)

    names = [f"k{i:02d}" for i in range(40)]
    held = next(name for name in names if held_out(name))
    kept = next(name for name in names if not held_out(name) and name > held)
    notes = text_folder(tmp_path / "notes", {held: "one text, twice", kept: "one text, twice"})
    raw = tmp_path / "raw"
    summary = ingest(raw, [f"text:{notes}"], val_fraction=0.5, dedupe=True)
    by_source = {s["name"]: s["samples"] for s in summary["manifest"]["sources"]}
    assert by_source == {"notes": 1, "val/notes": 0}
    rejects = [json.loads(line) for line in (raw / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["key"]) for r in rejects] == [("duplicate", f"notes-{held}_txt")]
    assert f"the same content as {kept}.txt in notes (--dedupe" in rejects[0]["detail"]


def test_a_validation_split_too_small_to_measure_a_source_is_warned(tmp_path, capsys):
    sources = [
        {"name": "code", "samples": 41},
        {"name": "val/code", "samples": 1},
        {"name": "notes", "samples": 900},
        {"name": "val/notes", "samples": 100},
        {"name": "tiny", "samples": 6},
    ]
    lines = thin_validation(sources, {"code": 0.2341, "notes": 0.01, "tiny": None})
    assert len(lines) == 2
    assert lines[0].startswith(
        f"warning: validation holds 1 of 42 code document(s) (fewer than {MIN_VAL_DOCS})"
    )
    assert "--val-fraction 0.24 holds out 10 or more of them" in lines[0]
    assert "validation holds 0 of 6 tiny" in lines[1] and "too small to split" in lines[1]

    notes = text_folder(tmp_path / "notes", {f"n{i}": f"note number {i}" for i in range(30)})
    argv = ["ingest", "--out", str(tmp_path / "raw"), "--source", f"text:{notes}"]
    assert prep_main([*argv, "--val-fraction", "0.1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warning: validation holds" in out and "notes document(s)" in out
    # the advised fraction holds out as many as it says (1/3 by the documents' share would not:
    # the split goes by each key's hash)
    advised = re.search(r"--val-fraction ([0-9.]+) holds out (\d+)", out)
    assert advised, out
    again = ["ingest", "--out", str(tmp_path / "raw2"), "--source", f"text:{notes}"]
    assert prep_main([*again, "--val-fraction", advised[1], "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"{advised[2]} samples in {tmp_path / 'raw2'}/val/" in out, out
    assert "warning: validation holds" not in out


def test_dedupe_across_partitions_and_merge(tmp_path):
    """Partitioned ingests dedupe once every shard exists; `merge` afterwards changes nothing."""
    notes = text_folder(tmp_path / "notes", TEXTS)
    raw = tmp_path / "raw"
    for part in (0, 1):
        ingest(
            raw,
            [f"text:{notes}"],
            shard_max_samples=1,
            num_partitions=2,
            partition=part,
            dedupe=True,
        )
    rejects = (raw / "rejects.jsonl").read_text()
    assert [json.loads(line)["key"] for line in rejects.splitlines()] == [
        "notes-c_txt",
        "notes-d_txt",
    ]
    assert prep_main(["merge", str(raw)]) == 0
    assert (raw / "rejects.jsonl").read_text() == rejects
    assert collect_stats(raw)["samples"] == 2 and verify(raw)["ok"]
