"""Parquet tables and Hugging Face ``save_to_disk`` folders as ingest sources: image/caption
tables (bytes, paths, ``Image()`` structs), OBELICS-style interleaved rows, text tables; with
the same rejects and accounting as the other kinds."""

from __future__ import annotations

import json

import pytest
import webdataset as wds
from factories import jpeg_bytes, png_bytes

from data.ingest import ingest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def docs_of(out) -> dict[str, dict]:
    urls = [str(p) for p in sorted(out.rglob("*.tar"))]
    return {s["__key__"]: json.loads(s["json"]) for s in wds.WebDataset(urls, shardshuffle=False)}


def rejects_of(out) -> set[tuple[str, str]]:
    lines = (out / "rejects.jsonl").read_text().splitlines()
    return {(r["path"], r["reason"]) for r in map(json.loads, lines)}


def test_image_table_with_bytes_paths_and_structs(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "b.png").write_bytes(png_bytes())
    cut = jpeg_bytes(64, 48)
    table = pa.table(
        {
            "id": ["a", "b", "c", "d", "../evil", "f"],
            "image": [
                {"bytes": jpeg_bytes(seed=1), "path": None},  # a Hugging Face Image() cell
                {"bytes": None, "path": "pics/b.png"},
                {"bytes": cut[: len(cut) // 2], "path": None},
                None,
                {"bytes": jpeg_bytes(seed=2), "path": None},
                {"bytes": None, "path": "pics/gone.png"},
            ],
            "caption": ["one", "two", "three", "four", "five", "six"],
            "score": [0.5, 0.25, 0.1, 0.2, 0.3, 0.4],
        }
    )
    pq.write_table(table, tmp_path / "laion.parquet", row_group_size=2)
    out = tmp_path / "out"
    s = ingest(out, [f"images:{tmp_path / 'laion.parquet'}"])
    docs = docs_of(out)
    assert sorted(docs) == ["laion-a", "laion-b"]
    a = docs["laion-a"]
    assert [g["type"] for g in a["segments"]] == ["image", "text"]
    assert a["segments"][1] == {"type": "text", "text": "one", "role": "caption"}
    assert a["meta"] == {"score": 0.5} and a["origin"] == {"path": "laion.parquet", "row": 0}
    assert rejects_of(out) == {
        ("laion.parquet:row 2", "truncated-image"),
        ("laion.parquet:row 3", "bad-record"),
        ("laion.parquet:row 4", "unsafe-name"),
        ("laion.parquet:row 5 (pics/gone.png)", "missing-media"),
    }
    t = s["manifest"]["totals"]
    assert t["samples"] + t["rejects"] == 6
    details = {
        json.loads(line)["path"]: json.loads(line)["detail"]
        for line in (out / "rejects.jsonl").read_text().splitlines()
    }
    assert details["laion.parquet:row 3"] == 'column "image": no media in this cell'


def test_interleaved_obelics_table(tmp_path):
    (tmp_path / "i.png").write_bytes(png_bytes())
    table = pa.table(
        {
            "texts": [["intro", None, "after"], ["alone"], ["x", None]],
            "images": [[None, jpeg_bytes(seed=3), None], [None], [None, None]],
            "url": ["u1", "u2", "u3"],
        }
    )
    pq.write_table(table, tmp_path / "obelics.parquet")
    paths = pa.table({"texts": [[None, "caption"]], "images": [["i.png", None]]})
    pq.write_table(paths, tmp_path / "paths.parquet")
    bad = pa.table({"texts": [["a", "b"]], "images": [["i.png"]]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    out = tmp_path / "out"
    ingest(
        out,
        [
            f"interleaved:{tmp_path / 'obelics.parquet'}",
            f"interleaved:{tmp_path / 'paths.parquet'}",
            f"interleaved:{tmp_path / 'bad.parquet'}",
        ],
    )
    docs = docs_of(out)
    assert [g["type"] for g in docs["obelics-00000000"]["segments"]] == ["text", "image", "text"]
    assert docs["obelics-00000000"]["meta"] == {"url": "u1"}
    assert [g["type"] for g in docs["obelics-00000001"]["segments"]] == ["text"]
    assert [g["type"] for g in docs["paths-00000000"]["segments"]] == ["image", "text"]
    assert rejects_of(out) == {("bad.parquet:row 0", "bad-record")}
    assert "obelics-00000002" in docs  # ["x", None] is a text-only document


def test_text_table_matches_the_same_text_as_jsonl(tmp_path):
    texts = ["first document", "second\nwith a newline", None, "fourth"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=3)
    with open(tmp_path / "t.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    a, b = tmp_path / "a", tmp_path / "b"
    ingest(a, [f"text:{tmp_path / 't.parquet'}"])
    ingest(b, [f"text:{tmp_path / 't.jsonl'}"])
    seg = {k: d["segments"] for k, d in docs_of(a).items()}
    assert sorted(seg) == ["t-00000000", "t-00000001", "t-00000003"]
    assert list(seg.values()) == [d["segments"] for d in docs_of(b).values()]
    assert rejects_of(a) == {("t.parquet:row 2", "bad-record")}


def test_hugging_face_save_to_disk_folders(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": jpeg_bytes(seed=i), "path": f"{i}.jpg"} for i in range(5)],
            "caption": [f"caption {i}" for i in range(5)],
        },
        features=datasets.Features(
            {"image": datasets.Image(), "caption": datasets.Value("string")}
        ),
    )
    ds.save_to_disk(str(tmp_path / "hf_images"), max_shard_size="2KB")  # several .arrow files
    assert len(list((tmp_path / "hf_images").glob("*.arrow"))) > 1
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "hf_text"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hf_dict"))
    out = tmp_path / "out"
    s = ingest(out, [f"images:{tmp_path / 'hf_images'}", f"text:{tmp_path / 'hf_text'}"])
    docs = docs_of(out)
    assert s["manifest"]["totals"]["samples"] == 8 and s["manifest"]["totals"]["rejects"] == 0
    captions = sorted(d["segments"][1]["text"] for d in docs.values() if d["kind"] == "images")
    assert captions == [f"caption {i}" for i in range(5)]
    with pytest.raises(ValueError, match="DatasetDict; pass one split"):
        ingest(tmp_path / "dict", [f"images:{tmp_path / 'hf_dict'}"])


@pytest.mark.parametrize("damaged", ["text", "id"])
def test_a_damaged_row_group_rejects_its_rows_and_keeps_the_others(tmp_path, damaged):
    """The page header of row group 1 of 3 overwritten, in the text column (read when a row is
    loaded) or the id column (read when the inputs are listed): that group's two rows are
    corrupt-table rejects naming the row group, the rows of groups 0 and 2 are ingested."""
    path = tmp_path / "notes.parquet"
    table = pa.table({"id": [f"n{n}" for n in range(6)], "text": [f"note {n}" for n in range(6)]})
    pq.write_table(table, path, row_group_size=2)
    column = table.schema.names.index(damaged)
    start = pq.ParquetFile(path).metadata.row_group(1).column(column).data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + 16] = b"\x0f" * 16
    path.write_bytes(bytes(raw))
    out = tmp_path / "out"
    s = ingest(out, [f"text:{path}"])
    assert s["manifest"]["totals"]["samples"] == 4
    assert rejects_of(out) == {
        ("notes.parquet:row 2", "corrupt-table"),
        ("notes.parquet:row 3", "corrupt-table"),
    }
    detail = json.loads((out / "rejects.jsonl").read_text().splitlines()[0])["detail"]
    assert detail.startswith("row group 1 cannot be read (")


def test_caption_cells_as_writers_leave_them(tmp_path):
    """Plain binary strings (older Spark/Hive), pandas' NaN for a missing caption and for the
    gap in an integer id column, numbers, a boolean, and a Hugging Face dataset's ``text``
    column: each is a caption, no caption, or a reject naming the row, never a Python repr."""
    pic = png_bytes()
    table = pa.table(
        {
            "id": pa.array([1.0, float("nan"), 3.0, 4.0, 5.0], pa.float64()),
            "image": [pic] * 5,
            "caption": pa.array(
                [b"red square", "gr\u00fcn".encode(), None, b"bad \xc3\x28", None], pa.binary()
            ),
        }
    )
    pq.write_table(table, tmp_path / "bin.parquet")
    numbers = pa.table({"image": [pic] * 3, "caption": pa.array([1.5, float("nan"), 1e5])})
    pq.write_table(numbers, tmp_path / "num.parquet")
    pq.write_table(pa.table({"image": [pic], "caption": [True]}), tmp_path / "bool.parquet")
    pq.write_table(pa.table({"image": [pic], "text": ["a blue one"]}), tmp_path / "hf.parquet")
    out = tmp_path / "out"
    ingest(out, [f"images:{tmp_path / name}.parquet" for name in ("bin", "num", "bool", "hf")])
    captions = {
        key: [seg["text"] for seg in doc["segments"] if seg["type"] == "text"]
        for key, doc in docs_of(out).items()
    }
    assert captions == {
        "bin-1": ["red square"],
        "bin-00000001": ["gr\u00fcn"],  # NaN: no id, keyed by its row
        "bin-3": [],
        "bin-5": [],
        "num-00000000": ["1.5"],
        "num-00000001": [],
        "num-00000002": ["100000"],
        "hf-00000000": ["a blue one"],
    }
    assert rejects_of(out) == {
        ("bin.parquet:row 3", "not-utf8"),
        ("bool.parquet:row 0", "bad-record"),
    }


def test_video_bytes_are_stored_under_their_containers_name(tmp_path):
    """Bytes in a table's video column come with no name: a Matroska clip is stored as
    ``vid0.mkv``, an MP4 as ``vid0.mp4`` (the member's name tells whoever extracts it)."""
    from factories import mp4_bytes

    clips = [mp4_bytes(), mp4_bytes(container="matroska"), mp4_bytes(container="avi")]
    table = pa.table({"id": ["mp4", "mkv", "avi"], "video": clips, "caption": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "clips.parquet")
    out = tmp_path / "out"
    ingest(out, [f"videos:{tmp_path / 'clips.parquet'}"])
    members = {
        key: [seg["member"] for seg in doc["segments"] if seg["type"] == "video"]
        for key, doc in docs_of(out).items()
    }
    assert members == {
        "clips-mp4": ["vid0.mp4"],
        "clips-mkv": ["vid0.mkv"],
        "clips-avi": ["vid0.avi"],
    }
