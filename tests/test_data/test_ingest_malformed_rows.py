"""Malformed table rows are rejects that name their line, never silent changes. Before: a CSV row
``a.png,too,many,fields`` became the caption "too" with the rest dropped; an unterminated quote
swallowed the next row into one ``missing-media`` reject; a blank JSONL line was neither a
sample nor a reject; an undecodable video's reject detail could read ``3`` (decord echoes the
input's bytes into its message)."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from factories import mp4_bytes, png_bytes

from data.cli import EXIT_REJECTS, main
from data.media import probe_video


def run_ingest(out: Path, *sources: str) -> tuple[int, list[dict], dict]:
    argv = ["ingest", "--out", str(out), "--no-progress"]
    for source in sources:
        argv += ["--source", source]
    status = main(argv)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    return status, rejects, json.loads((out / "manifest.json").read_text())


def captions_of(out: Path) -> dict[str, str]:
    import webdataset as wds

    urls = [str(path) for path in sorted(out.rglob("*.tar"))]
    found = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        doc = json.loads(sample["json"])
        found[doc["origin"]["path"]] = " ".join(
            seg["text"] for seg in doc["segments"] if seg["type"] == "text"
        )
    return found


def test_malformed_csv_rows_are_rejected_naming_their_line(tmp_path):
    for name in ("ok", "a", "b", "c", "d", "e"):
        (tmp_path / f"{name}.png").write_bytes(png_bytes())
    (tmp_path / "caps.csv").write_text(
        "image,caption\n"  # line 1
        "ok.png,a fine caption\n"  # 2
        "a.png,too,many,fields\n"  # 3: four fields under a two-column header
        'd.png,"a caption over\ntwo lines, quoted"\n'  # 4-5: a proper quoted newline
        "e.png\n"  # 6: one field
        '"b.png,an unterminated quote\n'  # 7: the quote is never closed
        "c.png,the row after it\n"  # 8: still a row of its own
    )
    status, rejects, manifest = run_ingest(tmp_path / "out", f"images:{tmp_path / 'caps.csv'}")
    assert status == EXIT_REJECTS
    got = {r["path"]: (r["reason"], r["detail"]) for r in rejects}
    assert set(got) == {"caps.csv:3", "caps.csv:6", "caps.csv:7"}
    assert got["caps.csv:3"][0] == "bad-row"
    assert "4 fields" in got["caps.csv:3"][1] and "header has 2" in got["caps.csv:3"][1]
    assert got["caps.csv:6"][0] == "bad-row" and "1 field" in got["caps.csv:6"][1]
    assert got["caps.csv:7"][0] == "bad-row"
    assert "quote" in got["caps.csv:7"][1] and "never closed" in got["caps.csv:7"][1]
    assert captions_of(tmp_path / "out") == {
        "ok.png": "a fine caption",
        "d.png": "a caption over\ntwo lines, quoted",
        "c.png": "the row after it",
    }
    assert manifest["totals"]["samples"] == 3


def test_a_quote_closed_rows_later_is_reported_and_the_rows_between_are_kept(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.png").write_bytes(png_bytes())
    (tmp_path / "caps.csv").write_text(
        'image,caption\na.png,"opens here\nb.png,plain\nc.png,"quoted, with a comma"\n'
    )
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{tmp_path / 'caps.csv'}")
    assert [(r["path"], r["reason"]) for r in rejects] == [("caps.csv:2", "bad-row")]
    assert "quote" in rejects[0]["detail"]
    assert captions_of(tmp_path / "out") == {"b.png": "plain", "c.png": "quoted, with a comma"}


def test_a_captions_csv_in_a_folder_rejects_its_malformed_rows(tmp_path):
    (tmp_path / "pics").mkdir()
    for name in ("a", "b"):
        (tmp_path / "pics" / f"{name}.png").write_bytes(png_bytes())
    (tmp_path / "pics" / "captions.csv").write_text("file,caption\na.png,fine\nb.png,too,many\n")
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{tmp_path / 'pics'}")
    assert [(r["path"], r["reason"]) for r in rejects] == [("captions.csv:3", "bad-row")]
    assert captions_of(tmp_path / "out") == {"a.png": "fine", "b.png": ""}


def test_a_csv_without_its_media_column_is_one_error_naming_the_header(tmp_path, capsys):
    """A ``filename,caption`` or semicolon-separated table gave a bad-record for every row; like
    a parquet table without the column, it is one line naming the header, exit code 2."""
    (tmp_path / "a.png").write_bytes(png_bytes())
    (tmp_path / "caps.csv").write_text("filename,caption\na.png,a caption\n")
    (tmp_path / "semi.csv").write_text("image;caption\na.png;a caption\n")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes())
    (tmp_path / "pics" / "captions.csv").write_text("name,caption\na.png,fine\n")
    for source, said in (
        (
            "caps.csv",
            "caps.csv:1: no 'image' or 'file' or 'path' column in the header (filename, caption)",
        ),
        ("semi.csv", "(image;caption) (semicolons: save it comma-separated)"),
        ("pics", "captions.csv:1: no 'file' column in the header (name, caption)"),
    ):
        argv = ["ingest", "--out", str(tmp_path / f"out-{source}"), "--no-progress"]
        assert main([*argv, "--source", f"images:{tmp_path / source}"]) == 2
        assert said in capsys.readouterr().err


def test_two_media_files_of_one_caption_file_keep_the_first(tmp_path):
    """coffee.bmp and coffee.tiff both took coffee.txt: one picture in two formats became two
    documents, which the split put on both sides. The second is listed, naming the first."""
    (tmp_path / "pics").mkdir()
    for name in ("coffee.bmp", "coffee.png", "tea.png"):
        (tmp_path / "pics" / name).write_bytes(png_bytes())
    (tmp_path / "pics" / "coffee.txt").write_text("a cup of coffee")
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{tmp_path / 'pics'}")
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [("coffee.png", "duplicate-key")]
    assert "its caption coffee.txt is coffee.bmp's too" in rejects[0]["detail"]
    assert captions_of(tmp_path / "out") == {"coffee.bmp": "a cup of coffee", "tea.png": ""}
    # a caption table that captions each, beside a .json of metadata only: both are kept
    (tmp_path / "two").mkdir()
    for name in ("coffee.bmp", "coffee.png"):
        (tmp_path / "two" / name).write_bytes(png_bytes())
    (tmp_path / "two" / "coffee.json").write_text('{"camera": "phone"}')
    (tmp_path / "two" / "captions.csv").write_text("file,caption\ncoffee.bmp,one\ncoffee.png,two\n")
    status, rejects, _ = run_ingest(tmp_path / "table", f"images:{tmp_path / 'two'}")
    assert status == 0 and rejects == []
    assert captions_of(tmp_path / "table") == {"coffee.bmp": "one", "coffee.png": "two"}


def test_a_hugging_face_imagefolders_metadata_captions_its_pictures(tmp_path):
    """datasets' ImageFolder layout: metadata.csv or .jsonl with file_name and text (it was an
    unknown-type reject, every picture kept uncaptioned); its other columns go to meta."""
    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("a", "b", "c"):
        (pics / f"{name}.png").write_bytes(png_bytes())
    (pics / "metadata.csv").write_text("file_name,text\na.png,a red square\n")
    rows = [{"file_name": "b.png", "text": "a blue one", "label": 3}, {"text": "no file"}]
    (pics / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert captions_of(tmp_path / "out") == {
        "a.png": "a red square",
        "b.png": "a blue one",
        "c.png": "",
    }
    assert [(r["path"], r["reason"], r["detail"]) for r in rejects] == [
        ("metadata.jsonl:2", "bad-record", 'no "file_name" column')
    ]
    # another tool's metadata.csv (no file_name) is one more file of the folder, as before
    (pics / "metadata.jsonl").unlink()
    (pics / "metadata.csv").write_text("filename,iso\na.png,100\n")
    status, rejects, _ = run_ingest(tmp_path / "other", f"images:{pics}")
    assert status == EXIT_REJECTS and [(r["path"], r["reason"]) for r in rejects] == [
        ("metadata.csv", "unknown-type")
    ]
    (pics / "metadata.csv").write_text("file_name,text\na.png,a red square\n")
    (pics / "metadata.csv").rename(pics / "Metadata.CSV")
    _, rejects, _ = run_ingest(tmp_path / "out2", f"images:{pics}")
    (said,) = [r["detail"] for r in rejects if r["path"] == "Metadata.CSV"]
    assert said.endswith("; a caption table is read under the name metadata.csv")


def test_an_imagefolders_split_metadata_names_files_in_its_own_folder(tmp_path):
    """datasets' split layout: train/metadata.csv and test/metadata.jsonl, each naming files
    relative to its own folder; file_name is the file even where a row has a "file" column
    too (that one is kept in meta); a captions.csv below the top is a file like another."""
    pics = tmp_path / "pics"
    for split in ("train", "test", "other"):
        (pics / split / "sub").mkdir(parents=True)
        (pics / split / "a.png").write_bytes(png_bytes())
    (pics / "train" / "sub" / "b.png").write_bytes(png_bytes())
    (pics / "train" / "metadata.csv").write_text(
        "file_name,text,file\na.png,a train picture,orig/1.png\n./sub/b.png,a deeper one,\n"
        "gone.png,no such file,\n"
    )
    (pics / "test" / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a test one"}\n')
    (pics / "other" / "captions.csv").write_text("file,caption\na.png,not read here\n")
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert status == EXIT_REJECTS
    assert captions_of(tmp_path / "out") == {
        "train/a.png": "a train picture",
        "train/sub/b.png": "a deeper one",
        "test/a.png": "a test one",
        "other/a.png": "",
    }
    assert [(r["path"], r["reason"]) for r in rejects] == [
        ("train/metadata.csv:4 (train/gone.png)", "missing-media"),
        ("other/captions.csv", "unknown-type"),
    ]
    assert rejects[1]["detail"].endswith("; a captions.csv is read at the folder's top only")
    import webdataset as wds

    urls = [str(path) for path in sorted((tmp_path / "out").rglob("*.tar"))]
    docs = [json.loads(s["json"]) for s in wds.WebDataset(urls, shardshuffle=False)]
    (meta,) = [doc["meta"] for doc in docs if doc["origin"]["path"] == "train/a.png"]
    assert meta.get("file") == "orig/1.png"


def test_caption_rows_for_absent_or_already_captioned_files_are_listed(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png_bytes())
    (tmp_path / "pics" / "captions.jsonl").write_text(
        '{"file": "a.png", "caption": "first"}\n'
        '{"file": "gone.png", "caption": "its file is absent"}\n'
        '{"file": "a.png", "caption": "second"}\n'
    )
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{tmp_path / 'pics'}")
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [
        ("captions.jsonl:3", "duplicate-key"),
        ("captions.jsonl:2 (gone.png)", "missing-media"),
    ]
    assert "captions.jsonl:1" in rejects[0]["detail"]
    # Keys, a reject's too, are letters, digits, "_" and "-" (docs/formats.md), never a dot.
    assert [r["key"] for r in rejects] == ["pics-captions_jsonl_3", "pics-captions_jsonl_2"]
    assert captions_of(tmp_path / "out") == {"a.png": "first"}


def test_blank_jsonl_and_csv_lines_are_listed(tmp_path):
    (tmp_path / "ok.png").write_bytes(png_bytes())
    (tmp_path / "notes.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n   \n')
    (tmp_path / "caps.jsonl").write_text('{"image": "ok.png"}\n\n')
    (tmp_path / "caps.csv").write_text("image,caption\n\nok.png,x\n")
    (tmp_path / "docs.jsonl").write_text('\n{"texts": ["a"], "images": [null]}\n')
    # a spreadsheet's export: unnamed empty columns, and an empty row of commas
    (tmp_path / "sheet.csv").write_bytes(b"image,caption,,\r\nok.png,red,,\r\n,,,\r\n")
    status, rejects, manifest = run_ingest(
        tmp_path / "out",
        f"text:{tmp_path / 'notes.jsonl'}",
        f"images:{tmp_path / 'caps.jsonl'}",
        f"csv=images:{tmp_path / 'caps.csv'}",
        f"interleaved:{tmp_path / 'docs.jsonl'}",
        f"images:{tmp_path / 'sheet.csv'}",
    )
    assert status == 0  # blank lines are listed, but hold nothing to keep
    assert {(r["path"], r["reason"]) for r in rejects} == {
        ("notes.jsonl:2", "blank-line"),
        ("notes.jsonl:4", "blank-line"),
        ("caps.jsonl:2", "blank-line"),
        ("caps.csv:2", "blank-line"),
        ("docs.jsonl:1", "blank-line"),
        ("sheet.csv:3", "blank-line"),
    }
    assert manifest["totals"]["samples"] == 6
    with tarfile.open(next((tmp_path / "out" / "sheet").glob("*.tar"))) as tar:
        (doc,) = [json.load(tar.extractfile(m)) for m in tar if m.name.endswith(".json")]
    assert doc["meta"] == {}  # not {"": ""}


def test_an_undecodable_videos_reject_detail_is_a_readable_message(tmp_path):
    cut = mp4_bytes()
    inputs = {
        "three": b"3",
        "noise": bytes(range(256)) * 4 + b"\n3\n",
        "text": b"hello, this is not a video\n" * 8,
        "cut": cut[: len(cut) // 2],
        "random": os.urandom(3000),
    }
    for name, raw in inputs.items():
        reject = probe_video(raw, f"{name}.mp4", max_seconds=60)
        assert reject.reason == "undecodable-video", name
        assert reject.detail.startswith("decord cannot read it: "), (name, reject.detail)
        message = reject.detail.removeprefix("decord cannot read it: ")
        assert message.isascii() and message.isprintable() and len(message) > 10, reject.detail
        assert "hello" not in message and "opening" not in message, reject.detail
    assert "moov atom not found" in probe_video(inputs["cut"], "c.mp4", max_seconds=60).detail
    # through ingest: the reject in rejects.jsonl reads the same
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "bad.mp4").write_bytes(b"3")
    _, rejects, _ = run_ingest(tmp_path / "out", f"videos:{tmp_path / 'clips'}")
    (reject,) = rejects
    assert reject["detail"] == "decord cannot read it: Invalid data found when processing input"


def test_a_caption_row_for_a_file_with_a_sidecar_caption_is_kept_in_its_meta(tmp_path):
    """Two captions for one picture (its sidecar a.txt and a captions.csv row): the sidecar's is
    the caption and the row's stays in the document's meta with its other columns, never dropped
    unsaid; a .json sidecar's caption beside a .txt stays in meta likewise."""
    import webdataset as wds

    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("a", "b", "c"):
        (pics / f"{name}.png").write_bytes(png_bytes())
    (pics / "a.txt").write_text("from the sidecar")
    (pics / "c.txt").write_text("from c's text sidecar")
    (pics / "c.json").write_text('{"caption": "from c\'s json sidecar", "author": "me"}')
    (pics / "captions.csv").write_text(
        "file,caption,license\na.png,from the table,cc-by\nb.png,only here,cc0\n"
    )
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert status == 0 and rejects == []
    assert captions_of(tmp_path / "out") == {
        "a.png": "from the sidecar",
        "b.png": "only here",
        "c.png": "from c's text sidecar",
    }
    urls = [str(path) for path in sorted((tmp_path / "out").rglob("*.tar"))]
    metas = {
        doc["origin"]["path"]: doc["meta"]
        for doc in (json.loads(s["json"]) for s in wds.WebDataset(urls, shardshuffle=False))
    }
    assert metas["a.png"] == {"caption": "from the table", "license": "cc-by"}
    assert metas["b.png"] == {"license": "cc0"}
    assert metas["c.png"] == {"caption": "from c's json sidecar", "author": "me"}


def test_a_broken_json_sidecar_names_the_picture_it_leaves_out(tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "a.json").write_text('{"caption": ')
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [("a.png", "bad-record")]
    assert rejects[0]["detail"].startswith("its sidecar a.json: not valid JSON")


def test_a_caption_sidecar_not_in_utf8_is_named_in_the_reject(tmp_path):
    """A Latin-1 caption file rejects its picture; the detail names the caption file, the one
    to fix (it read as if the picture itself were text that is not UTF-8)."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "a.txt").write_bytes("A caf\xe9 table".encode("latin-1"))
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [("a.png", "not-utf8")]
    assert rejects[0]["detail"].startswith("its sidecar a.txt: invalid UTF-8 at byte 5")


def test_an_interleaved_record_whose_lists_are_strings_is_a_reject(tmp_path):
    """OBELICS texts/images given as a string, not a list: a bad-record naming the field. It was
    taken letter by letter, a document of one-letter texts."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes())
    rows = [
        {"texts": "a caption, not a list", "images": []},
        {"texts": [None], "images": "img/a.png"},
        {"texts": ["fine", None], "images": [None, "img/a.png"]},
        # both layouts: the texts were left out unsaid
        {"segments": [{"type": "text", "text": "a"}], "texts": ["b"], "images": [None]},
    ]
    (tmp_path / "pages.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, rejects, manifest = run_ingest(
        tmp_path / "out", f"interleaved:{tmp_path / 'pages.jsonl'}"
    )
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"], r["detail"]) for r in rejects] == [
        ("pages.jsonl:1", "bad-record", '"texts" is not a list'),
        ("pages.jsonl:2", "bad-record", '"images" is not a list'),
        ("pages.jsonl:4", "bad-record", 'both "segments" and "texts", "images": give one'),
    ]
    assert manifest["totals"]["samples"] == 1


def test_tables_with_a_byte_order_mark_or_a_row_not_in_utf8(tmp_path, capsys):
    """Excel's "CSV UTF-8" and Notepad open a file with a byte order mark: it is not part of the
    CSV header (a "file" column, not "\ufefffile") nor of the first JSON line. A CSV row that is
    not UTF-8 (Excel's other CSV) is a not-utf8 reject naming its line, not the end of the
    ingest."""
    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("a", "b"):
        (pics / f"{name}.png").write_bytes(png_bytes())
    bom = b"\xef\xbb\xbf"
    (pics / "captions.csv").write_bytes(
        bom + b"file,caption\r\na.png,from excel\r\nb.png,caf\xe9 cr\xe8me\r\n"
    )
    (tmp_path / "table.csv").write_bytes(bom + b"image,caption\r\npics/a.png,a table row\r\n")
    (tmp_path / "pages.jsonl").write_bytes(bom + b'{"texts": ["a page"], "images": [null]}\n')
    (tmp_path / "notes.jsonl").write_bytes(bom + b'{"text": "a note"}\n')
    status, rejects, manifest = run_ingest(
        tmp_path / "out",
        f"images:{pics}",
        f"tab=images:{tmp_path / 'table.csv'}",
        f"interleaved:{tmp_path / 'pages.jsonl'}",
        f"text:{tmp_path / 'notes.jsonl'}",
    )
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [("captions.csv:3", "not-utf8")]
    assert {s["name"]: s["samples"] for s in manifest["sources"]} == {
        "pics": 2,
        "tab": 1,
        "pages": 1,
        "notes": 1,
    }
    assert captions_of(tmp_path / "out")["a.png"] == "from excel"

    (tmp_path / "latin.csv").write_bytes(b"fil\xe9,caption\na.png,x\n")
    argv = ["ingest", "--out", str(tmp_path / "out2"), "--no-progress"]
    assert main([*argv, "--source", f"images:{tmp_path / 'latin.csv'}"]) == 2
    assert "latin.csv:1: the header row is not valid UTF-8" in capsys.readouterr().err

    # UTF-16, as Windows PowerShell 5 writes a table: its lines split between the bytes, so
    # lines of ASCII were kept and the others rejected as not UTF-8; refused whole, named
    lines = [json.dumps({"text": text}, ensure_ascii=False) for text in ("first – line", "ascii")]
    for name, data in [("wide.jsonl", "\n".join(lines)), ("wide.csv", "image,caption\na.png,x")]:
        (tmp_path / name).write_bytes((data + "\n").encode("utf-16"))
        kind = "text" if name.endswith("jsonl") else "images"
        assert main([*argv, "--source", f"{kind}:{tmp_path / name}"]) == 2
        said = f"{tmp_path / name}: UTF-16 (its byte order mark says so), not UTF-8: save the"
        assert said in capsys.readouterr().err
    # and without its mark (one record of two was kept, unsaid): known by its NULs
    (tmp_path / "unmarked.jsonl").write_bytes(("\n".join(lines) + "\n").encode("utf-16-le"))
    assert main([*argv, "--source", f"text:{tmp_path / 'unmarked.jsonl'}"]) == 2
    assert "unmarked.jsonl: UTF-16 without a byte order mark" in capsys.readouterr().err

    # headers as people type them, or tab-separated, are told what is wrong
    for header, hint in [
        ("Image,Caption", "column names are lower case"),
        ("image\tcaption", "tabs"),
    ]:
        (tmp_path / "typed.csv").write_text(f"{header}\na.png,x\n")
        assert main([*argv, "--source", f"images:{tmp_path / 'typed.csv'}"]) == 2
        assert f"({hint}" in capsys.readouterr().err


def test_nan_in_a_json_line_is_a_bad_record(tmp_path):
    """Python's json.dumps writes NaN and Infinity, which JSON has not: kept, the shard's JSON
    held them and was no JSON to other readers."""
    (tmp_path / "t.jsonl").write_text('{"text": "a", "score": NaN}\n{"text": "b", "x": 1}\n')
    status, rejects, manifest = run_ingest(tmp_path / "out", f"text:{tmp_path / 't.jsonl'}")
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 1
    assert [(r["path"], r["reason"], r["detail"]) for r in rejects] == [
        ("t.jsonl:1", "bad-record", "not valid JSON (NaN is not a JSON value)")
    ]


def test_a_sidecar_named_after_the_whole_file_name_says_the_name_it_needs(tmp_path):
    """``IMG.JPEG.txt`` beside ``IMG.JPEG`` (as some downloaders write it) is not read as the
    caption; its reject says which name would be."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "IMG.JPEG").write_bytes(png_bytes())
    (pics / "IMG.JPEG.txt").write_text("a caption under the wrong name")
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{pics}")
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [("IMG.JPEG.txt", "unknown-type")]
    assert rejects[0]["detail"] == (
        "not an image file (.txt); the caption sidecar of IMG.JPEG is named IMG.txt"
    )


def test_photos_and_clips_under_the_names_users_have_them_are_read(tmp_path, no_hang):
    """A JPEG saved as ``.jfif`` (browsers on Windows), an AVIF photo and a ``.3gp`` phone clip
    are media; a file of another kind says what to do with it, not only that it was not taken."""
    import io

    from PIL import Image, features

    pics, clips = tmp_path / "pics", tmp_path / "clips"
    pics.mkdir()
    clips.mkdir()
    photo = Image.new("RGB", (40, 30), (200, 30, 30))
    photo.save(pics / "saved.jfif", format="JPEG")
    if features.check("avif"):
        photo.save(pics / "phone.avif")
    (pics / "clip.mp4").write_bytes(mp4_bytes())
    buf = io.BytesIO()
    photo.save(buf, format="JPEG")
    (pics / "iphone.heic").write_bytes(buf.getvalue())  # the name is what matters here
    (pics / "orphan.txt").write_text("a caption whose photo was not copied")
    (pics / "photo.mp4").write_bytes(png_bytes())  # a picture under a video's name
    os.mkfifo(pics / "stream.raw")  # a named pipe: never opened (no hang), whatever its name
    (clips / "old_phone.3gp").write_bytes(mp4_bytes())
    (clips / "still.png").write_bytes(png_bytes())
    status, rejects, manifest = run_ingest(tmp_path / "out", f"images:{pics}", f"videos:{clips}")
    assert status == EXIT_REJECTS
    samples = {s["name"]: s["samples"] for s in manifest["sources"]}
    assert samples == {"pics": 2 if features.check("avif") else 1, "clips": 1}
    details = {r["path"]: r["detail"] for r in rejects if r["reason"] == "unknown-type"}
    assert details == {
        "clip.mp4": "not an image file (.mp4); give the videos a source of their own (videos:PATH)",
        "iphone.heic": "not an image file (.heic); HEIC/HEIF is not read: convert it to JPEG first",
        "orphan.txt": "not an image file (.txt); a caption with no image named orphan.*",
        "photo.mp4": "an image (PNG) under a .mp4 name: rename it to .png",
        "still.png": "not a video file (.png); give the images a source of their own (images:PATH)",
    }
    unreadable = {r["path"]: r["detail"] for r in rejects if r["reason"] == "unreadable-file"}
    assert unreadable == {"stream.raw": "not a regular file but a named pipe (FIFO): not opened"}


def test_an_interleaved_media_reject_names_its_line_and_a_video_listed_as_an_image(tmp_path):
    """A page's picture that cannot be read is named by the table's line and the path as given
    (it was named by its absolute path alone, so the line that lists it had to be searched for);
    a clip in the images list is said to belong in the videos list."""
    (tmp_path / "cut.png").write_bytes(png_bytes()[:40])
    (tmp_path / "clip.mp4").write_bytes(mp4_bytes())
    rows = [
        {"texts": ["a page", None], "images": [None, "cut.png"]},
        {"texts": ["a page with a clip", None], "images": [None, "clip.mp4"]},
        {
            "texts": ["a page with a clip", None],
            "images": [None, None],
            "videos": [None, "clip.mp4"],
        },
    ]
    (tmp_path / "pages.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, rejects, manifest = run_ingest(
        tmp_path / "out", f"interleaved:{tmp_path / 'pages.jsonl'}"
    )
    assert status == EXIT_REJECTS
    assert [(r["path"], r["reason"]) for r in rejects] == [
        ("pages.jsonl:1 (cut.png)", "unreadable-image"),
        ("pages.jsonl:2", "unknown-type"),
    ]
    assert rejects[1]["detail"] == "clip.mp4 is a video in the images: list it in videos"
    assert manifest["totals"]["samples"] == 1
    # an image table's rows too (two rows naming one damaged file were two lines alike)
    (tmp_path / "t.csv").write_text("image,caption\ncut.png,a\ncut.png,b\n")
    status, rejects, _ = run_ingest(tmp_path / "out2", f"images:{tmp_path / 't.csv'}")
    assert [(r["path"], r["reason"]) for r in rejects] == [
        ("t.csv:2 (cut.png)", "unreadable-image"),
        ("t.csv:3 (cut.png)", "unreadable-image"),
    ]


def test_names_written_decomposed_match_tables_that_write_them_composed(tmp_path):
    """macOS writes file names decomposed (NFD: "e" + U+0301); a caption table typed elsewhere
    holds them composed (NFC: U+00E9). Linux compares bytes: café.jpg was "no file café.jpg in
    the folder" beside the very file, and a JSONL or interleaved table's row a missing-media."""
    import unicodedata

    pics = tmp_path / "pics"
    pics.mkdir()
    composed = unicodedata.normalize("NFC", "café.png")
    (pics / unicodedata.normalize("NFD", "café.png")).write_bytes(png_bytes())
    (pics / "captions.csv").write_text(f"file,caption\n{composed},a cup\n")
    (pics / "rows.jsonl").write_text(
        json.dumps({"image": composed, "caption": "from a table"}) + "\n"
    )
    (pics / "pages.jsonl").write_text(
        json.dumps({"texts": ["a page", None], "images": [None, composed]}) + "\n"
    )
    status, rejects, manifest = run_ingest(
        tmp_path / "out",
        f"pics=images:{pics}",
        f"rows=images:{pics / 'rows.jsonl'}",
        f"pages=interleaved:{pics / 'pages.jsonl'}",
    )
    assert [(r["path"], r["reason"]) for r in rejects if r["source"] == "pics"] == [
        ("pages.jsonl", "unknown-type"),
        ("rows.jsonl", "unknown-type"),
    ]
    assert {s["name"]: s["samples"] for s in manifest["sources"]} == {
        "pics": 1,
        "rows": 1,
        "pages": 1,
    }
    assert "a cup" in captions_of(tmp_path / "out").values()


def test_a_table_written_on_windows_is_told_how_folders_are_separated(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png_bytes())
    (tmp_path / "pics.csv").write_text("image,caption\nmedia\\a.png,a path from Windows\n")
    status, rejects, _ = run_ingest(tmp_path / "out", f"images:{tmp_path / 'pics.csv'}")
    assert [(r["path"], r["reason"], r["detail"]) for r in rejects] == [
        (
            "pics.csv:2 (media\\a.png)",
            "missing-media",
            "file does not exist (folders are separated by / here, not \\)",
        )
    ]


def test_json_values_of_the_wrong_kind_are_rejects_naming_their_line(tmp_path):
    """A number or a list where a segment's text or path belongs, and a number beyond a float's
    range (Python would write it back as Infinity, which is no JSON): the line is a bad-record,
    the rest of the file is ingested."""
    (tmp_path / "a.png").write_bytes(png_bytes())
    lines = [
        {"segments": [{"type": "text", "text": "fine", "role": "caption"}]},
        {"segments": [{"type": "text", "text": 5}]},
        {"segments": [{"type": "code", "text": ["a", "b"]}]},
        {"segments": [{"type": "text", "text": True}]},
        {"segments": [{"type": "image", "path": 5}]},
        {"segments": [{"type": "image", "path": "a.png", "file": {"a": 1}}]},
    ]
    table = tmp_path / "pages.jsonl"
    table.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(table, "a") as f:
        f.write('{"segments": [{"type": "text", "text": "big"}], "score": 1e400}\n')
    status, rejects, manifest = run_ingest(tmp_path / "out", f"interleaved:{table}")
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 1
    assert [(r["path"], r["reason"]) for r in rejects] == [
        (f"pages.jsonl:{n}", "bad-record") for n in range(2, 8)
    ]
    assert rejects[0]["detail"] == 'segment 0: its "text" is 5, not a string'
    assert rejects[4]["detail"] == 'segment 0: its "file" is {"a": 1}, not a string'
    assert "1e400 is beyond a float's range" in rejects[5]["detail"]
    import webdataset as wds

    (tar,) = (tmp_path / "out").rglob("*.tar")
    (doc,) = [json.loads(s["json"]) for s in wds.WebDataset(str(tar), shardshuffle=False)]
    assert doc["segments"] == [{"type": "text", "text": "fine", "role": "caption"}]


def test_a_caption_column_by_another_name_is_the_caption(tmp_path):
    """A header written by hand (``image, caption``), a capitalised ``Caption``, and a Hugging
    Face ``text`` column: each is read as the caption, not moved into the meta."""
    (tmp_path / "a.png").write_bytes(png_bytes())
    for name, header in (
        ("spaced", "image, caption"),
        ("upper", "image,Caption"),
        ("hf", "image,text"),
    ):
        (tmp_path / f"{name}.csv").write_text(f"{header}\na.png,a red square {name}\n")
    sources = [f"images:{tmp_path / name}.csv" for name in ("spaced", "upper", "hf")]
    status, rejects, _ = run_ingest(tmp_path / "out", *sources)
    assert status == 0 and rejects == []
    import webdataset as wds

    urls = [str(path) for path in sorted((tmp_path / "out").rglob("*.tar"))]
    docs = [json.loads(s["json"]) for s in wds.WebDataset(urls, shardshuffle=False)]
    assert sorted(seg["text"] for doc in docs for seg in doc["segments"] if "text" in seg) == [
        f"a red square {name}" for name in ("hf", "spaced", "upper")
    ]
    assert all(doc["meta"] == {} for doc in docs)


def test_a_path_that_can_name_no_file_is_its_rows_reject(tmp_path):
    """A name over 255 bytes, a NUL, a data: URI in the image column: that row is a reject
    naming it (cut short), the table's other rows are ingested."""
    (tmp_path / "a.png").write_bytes(png_bytes())
    uri = "data:image/png;base64," + "A" * 5000
    rows = [{"image": "a.png"}, {"image": "b" * 300 + ".png"}, {"image": "c\0.png"}, {"image": uri}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    pages = [{"segments": [{"type": "image", "path": row["image"]}]} for row in rows]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(page) + "\n" for page in pages))
    status, rejects, manifest = run_ingest(
        tmp_path / "out", f"images:{tmp_path / 't.jsonl'}", f"interleaved:{tmp_path / 'p.jsonl'}"
    )
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 2
    assert [(r["path"].split(" ")[0], r["reason"]) for r in rejects] == [
        ("t.jsonl:2", "missing-media"),
        ("t.jsonl:3", "missing-media"),
        ("t.jsonl:4", "missing-media"),
        ("p.jsonl:2", "missing-media"),
        ("p.jsonl:3", "missing-media"),
        ("p.jsonl:4", "missing-media"),
    ]
    details = [r["detail"] for r in rejects]
    assert "is 304 bytes long (file systems allow 255)" in details[0]
    assert "holds a NUL byte" in details[1]
    assert "a data: URI, not a path" in details[2] and "a data: URI, not a path" in details[5]
    assert all(len(r["path"]) + len(r["detail"]) < 400 for r in rejects)


def test_hints_for_what_users_leave_in_their_folders_and_tables(tmp_path, capsys):
    """A kohya .caption sidecar, a spreadsheet cell with spaces around its path, an OSCAR-style
    JSONL (``content``), a .markdown file: each read, or refused with what to change."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "a.caption").write_text("a red square")
    (tmp_path / "t.csv").write_text("image,caption\npics/a.png ,spaced\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "read.markdown").write_text("# Notes\n\nSome prose.\n")
    (tmp_path / "oscar.jsonl").write_text('{"content": "words", "id": 1}\n')
    status, rejects, manifest = run_ingest(
        tmp_path / "out",
        f"images:{pics}",
        f"images:{tmp_path / 't.csv'}",
        f"text:{tmp_path / 'notes'}",
        f"text:{tmp_path / 'oscar.jsonl'}",
    )
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 2  # a.png, read.markdown
    details = {r["path"]: r["detail"] for r in rejects}
    assert details["a.caption"].endswith("captions are read from a.txt: rename the .caption files")
    assert details["t.csv:2 (pics/a.png )"].endswith("the path has spaces around it)")
    assert details["oscar.jsonl:1"] == 'no string field "text" (its fields: content, id)'
    said = capsys.readouterr().out  # a source that gave nothing is named (t: its one row failed)
    assert "warning: source oscar (text) gave no document: all 1 of its inputs" in said
    assert "warning: source t (images) gave no document" in said
    assert "warning: source pics" not in said


def test_a_csv_caption_too_long_for_a_csv_table_is_said_so(tmp_path):
    """A properly quoted caption of 200k characters on one line is no unclosed quote: the row
    is a bad-row that says the field is too long for a CSV table, the next row is read."""
    (tmp_path / "a.png").write_bytes(png_bytes())
    long = "word " * 40_000
    (tmp_path / "t.csv").write_text(f'image,caption\na.png,"{long}"\na.png,short\n')
    status, rejects, manifest = run_ingest(tmp_path / "out", f"images:{tmp_path / 't.csv'}")
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 1
    assert [(r["path"], r["reason"]) for r in rejects] == [("t.csv:2", "bad-row")]
    assert "a field of over 131,072 characters: too long for a CSV table" in rejects[0]["detail"]
