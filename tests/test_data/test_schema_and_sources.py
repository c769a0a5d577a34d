"""Keys, source specs and the per-kind listing rules."""

from __future__ import annotations

import argparse
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from factories import png_bytes

from data.cli import build_parser, main, parse_size
from data.ingest import ingest
from data.schema import (
    REASONS,
    Reject,
    is_valid_key,
    sanitize_key,
    unsafe_name_reason,
    validate_doc,
)
from data.sources import parse_sources


def test_keys_never_hold_dots_or_separators():
    for raw in ["a/b.py", "../../etc/passwd", "x y.z", "Ünïcode.txt", "....", "a\\b"]:
        k = sanitize_key(raw)
        assert is_valid_key(k) and "." not in k and "/" not in k


def test_names_outside_ascii_keep_keys_of_their_own():
    """Every character outside the key alphabet becomes "_": names in Chinese or Cyrillic that
    differ only there all met in one key (照片1.jpg and 图片1.jpg were both ``1_jpg``, 三国.txt
    and 红楼梦.txt both ``txt``), each after the first a duplicate-key reject. ASCII names keep
    the keys docs/formats.md gives."""
    names = ["照片1.jpg", "图片1.jpg", "三国.txt", "红楼梦.txt", "Фото 001.jpg", "Кадр 001.jpg"]
    keys = [sanitize_key(name) for name in names]
    assert len(set(keys)) == len(names) and all(map(is_valid_key, keys))
    assert keys[0].startswith("1_jpg-") and sanitize_key("照片1.jpg") == keys[0]
    assert sanitize_key("pkg/mod.py") == "pkg_mod_py"


def test_long_paths_keep_keys_a_tar_can_extract():
    """A 254-character file name in five 60-character folders: its key keeps a start and a
    digest of the whole, so a member's name stays under the 255 bytes ``tar -x`` may write."""
    folders = "/".join(f"{n}" * 60 for n in range(5))
    a, b = (sanitize_key(f"{folders}/{c * 250}.py") for c in "xy")
    assert len(a) == len(b) == 160 and a != b and a[:151] == b[:151] and is_valid_key(a)
    assert sanitize_key("short/name.py") == "short_name_py"


def test_source_names_stay_short_enough_for_member_names(tmp_path):
    """A source named after a 100-character folder keeps 55 of them and a digest (64 in all);
    a longer name given is refused: with a key and an extension, a member name fits 255 bytes."""
    folder = tmp_path / ("x" * 100)
    folder.mkdir()
    (name,) = (spec.name for spec in parse_sources([f"text:{folder}"]))
    assert len(name) == 64 and name.startswith("x" * 55 + "-")
    with pytest.raises(ValueError, match="longer than 64 characters"):
        parse_sources([f"{'y' * 65}=text:{folder}"])


def test_unsafe_names_are_named():
    assert (
        unsafe_name_reason("../x")
        and unsafe_name_reason("/etc/x")
        and unsafe_name_reason("a/../../b")
    )
    assert unsafe_name_reason("C:\\x") and unsafe_name_reason("")
    assert unsafe_name_reason("dir/000001") is None


def test_reject_reasons_are_a_closed_list():
    with pytest.raises(ValueError):
        Reject("p", "made-up")
    assert all(REASONS.values())


def test_validate_doc():
    assert validate_doc({"segments": [{"type": "text", "text": "x"}]}, {"json"}) is None
    assert "missing" in validate_doc(
        {"segments": [{"type": "image", "member": "img0.png"}]}, {"json"}
    )
    assert validate_doc({"segments": []}, set()) == "no segments"


def test_source_specs(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "t.jsonl").write_text("")
    specs = parse_sources(
        [
            f"code:{tmp_path / 'code'}",
            f"mine=code:{tmp_path / 'code'}",
            f"text:{tmp_path / 't.jsonl'}",
        ]
    )
    assert [s.name for s in specs] == ["code", "mine", "t"]
    # Two sources of one name: an error naming both paths, never a silent rename.
    (tmp_path / "other" / "code").mkdir(parents=True)
    with pytest.raises(ValueError) as e:
        parse_sources([f"code:{tmp_path / 'code'}", f"text:{tmp_path / 'other' / 'code'}"])
    assert "'code' (from its path) is also the name of" in str(e.value)
    assert str(tmp_path / "code") in str(e.value) and str(tmp_path / "other" / "code") in str(
        e.value
    )
    with pytest.raises(ValueError, match="'t' is also the name of"):
        parse_sources([f"text:{tmp_path / 't.jsonl'}", f"t=code:{tmp_path / 'code'}"])
    with pytest.raises(ValueError, match="KIND one of"):
        parse_sources([f"pictures:{tmp_path}"])
    with pytest.raises(ValueError, match="does not exist"):
        parse_sources([f"text:{tmp_path / 'nope'}"])
    (tmp_path / "pano.jpg").write_bytes(png_bytes())
    with pytest.raises(ValueError, match=r"images takes a folder \(put pano\.jpg in a folder"):
        parse_sources([f"images:{tmp_path / 'pano.jpg'}"])
    # The folders an output holds beside the sources' own: a source named so would share them
    (tmp_path / "val").mkdir()
    with pytest.raises(ValueError, match=r"'val' is the folder of the held-out split.*val_data="):
        parse_sources([f"text:{tmp_path / 'val'}"])
    with pytest.raises(ValueError, match="'tokenizers' is the folder of the tokenizers"):
        parse_sources([f"tokenizers=code:{tmp_path / 'code'}"])


def test_sizes():
    assert (
        parse_size("256MB") == 256_000_000
        and parse_size("4MiB") == 4 << 20
        and parse_size("0") == 0
    )
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    for cmd in ("ingest", "merge", "stats", "verify", "demo-corpus"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([cmd, "--help"])
        assert e.value.code == 0
    assert "KIND:PATH" in capsys.readouterr().out


def _rejects(out) -> dict[str, str]:
    return {
        r["path"]: r["reason"]
        for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())
    }


def test_code_tree_rules(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def f():\n\treturn  1\n")
    (root / "pkg" / "lib.rs").write_text("fn main() {}\n")
    (root / "pkg" / "blob.py").write_bytes(b"\x00\x01\x02binary")
    (root / "pkg" / "app.min.js").write_text("var a=1;")
    (root / "pkg" / "bundle.js").write_text("var a=1;" * 200)  # minified whatever its name
    (root / "pkg" / "table.py").write_text("ROWS = [" + "1, " * 330 + "]\n")  # 999 bytes: kept
    (root / "pkg" / "README.md").write_text("A paragraph, one line. " * 80 + "\n")  # prose: kept
    # lines end at a lone CR too (an old Mac file), and count characters (3 bytes each here)
    (root / "pkg" / "mac.py").write_bytes(b"def f():\r    return 1\r" * 200)
    (root / "pkg" / "cjk.py").write_text("# " + "\u6f22" * 400 + "\nx = 1\n", encoding="utf-8")
    (root / "pkg" / "logo.png").write_bytes(png_bytes())
    (root / "pkg" / "huge.py").write_text("x = 1\n" * 400_000)
    (root / "node_modules" / "dep").mkdir(parents=True)
    (root / "node_modules" / "dep" / "i.js").write_text("1")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref")
    (root / "Makefile").write_text("all:\n\techo hi\n")
    # a script without an extension says its language in its #! line; named files of make,
    # and Dockerfile.NAME; a file of no extension and no #! stays unknown
    (root / "bin").mkdir()
    (root / "bin" / "serve").write_text("#!/usr/bin/env python3\nprint('hi')\n")
    (root / "bin" / "setup").write_text("#!/bin/sh -e\necho hi\n")
    (root / "bin" / "notes").write_text("just words\n")
    (root / "GNUmakefile").write_text("all:\n\techo hi\n")
    (root / "Dockerfile.dev").write_text("FROM python:3.11\n")
    (root / "Dockerfile.md").write_text("# How the image is built\n")  # Markdown, not a Dockerfile
    out = tmp_path / "out"
    s = ingest(out, [f"code:{root}"])
    assert _rejects(out) == {
        "bin/notes": "unknown-type",
        ".git/": "vendored",
        "node_modules/": "vendored",
        "pkg/blob.py": "binary-file",
        "pkg/app.min.js": "vendored",
        "pkg/bundle.js": "long-line",
        "pkg/logo.png": "not-code",
        "pkg/huge.py": "too-large",
    }
    assert (
        "a line of 1,600 characters"
        in json.loads(
            next(x for x in (out / "rejects.jsonl").read_text().splitlines() if "bundle.js" in x)
        )["detail"]
    )
    assert s["manifest"]["totals"]["samples"] == 12
    import webdataset as wds

    docs = [
        json.loads(x["json"])
        for x in wds.WebDataset(str(next((out / "repo").glob("*.tar"))), shardshuffle=False)
    ]
    by_path = {d["origin"]["path"]: d["segments"][0] for d in docs}
    assert by_path["pkg/mod.py"] == {
        "type": "code",
        "lang": "python",
        "text": "def f():\n\treturn  1\n",
    }
    assert by_path["Makefile"]["lang"] == "make" and by_path["pkg/lib.rs"]["lang"] == "rust"
    assert {
        path: by_path[path]["lang"] for path in by_path if "/" not in path or "bin" in path
    } == {
        "Makefile": "make",
        "GNUmakefile": "make",
        "Dockerfile.dev": "dockerfile",
        "Dockerfile.md": "markdown",
        "bin/serve": "python",
        "bin/setup": "shell",
    }


def test_paths_that_map_onto_one_key_are_all_read_and_system_files_skipped(tmp_path):
    """a/b.py, a_b.py and a b.py all map onto the key ``a_b_py``; each is its own document (the
    first listed keeps the plain key, the others a digest of their path). macOS's ._NAME files,
    .DS_Store and Thumbs.db are skipped in every kind of source: a ._NAME listed first took NAME's
    key and lost NAME as a duplicate."""
    code, photos, text = tmp_path / "code", tmp_path / "photos", tmp_path / "text"
    for folder in (code / "a", photos, text):
        folder.mkdir(parents=True)
    for rel in (
        "a/b.py",
        "a_b.py",
        "a b.py",
        "._a_b.py",
        "collections/abc.py",
        "_collections_abc.py",
    ):
        (code / rel).parent.mkdir(exist_ok=True)
        (code / rel).write_text(f"NAME = {rel!r}\n")
    for name in ("cat 1.jpg", "cat_1.jpg", "._cat_1.jpg"):
        (photos / name).write_bytes(png_bytes())
    (photos / "Thumbs.db").write_bytes(b"\x00" * 64)
    (photos / ".DS_Store").write_bytes(b"\x00" * 64)
    (text / "notes.txt").write_text("The real notes.\n")
    (text / "._notes.txt").write_bytes(b"\x00\x05\x16\x07Mac OS X")
    out = tmp_path / "out"
    s = ingest(out, [f"code:{code}", f"images:{photos}", f"text:{text}"])
    assert _rejects(out) == {
        "._a_b.py": "vendored",
        "._cat_1.jpg": "vendored",
        ".DS_Store": "vendored",
        "Thumbs.db": "vendored",
        "._notes.txt": "vendored",
    }
    assert s["manifest"]["totals"]["samples"] == 5 + 2 + 1
    import webdataset as wds

    keys = {
        x["__key__"]: json.loads(x["json"])["origin"]["path"]
        for tar in sorted(out.glob("*/*.tar"))
        for x in wds.WebDataset(str(tar), shardshuffle=False)
    }
    assert len(keys) == 8 and all(map(is_valid_key, keys))
    # a folder's files are listed before its subfolders, each in sorted order
    assert keys["code-a_b_py"] == "a b.py" and keys["text-notes_txt"] == "notes.txt"
    assert sorted(v for k, v in keys.items() if k.startswith("code-a_b_py-")) == [
        "a/b.py",
        "a_b.py",
    ]


def test_code_files_in_other_encodings(tmp_path):
    """A Python file in the coding its PEP 263 line declares and a UTF-16 file with its byte order
    mark are read as their authors wrote them; undeclared or false codings are rejected."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "legacy.py").write_bytes(b"# -*- coding: latin-1 -*-\nNAME = 'caf\xe9'\n")
    (root / "undeclared.py").write_bytes(b"NAME = 'caf\xe9'\n")
    (root / "lying.py").write_bytes(b"# coding: utf-8\nNAME = 'caf\xe9'\n")
    (root / "windows.c").write_bytes("int caf\u00e9 = 1;\n".encode("utf-16"))
    out = tmp_path / "out"
    ingest(out, [f"code:{root}"])
    assert _rejects(out) == {"undeclared.py": "not-utf8", "lying.py": "not-utf8"}
    import webdataset as wds

    docs = [
        json.loads(x["json"])
        for x in wds.WebDataset(str(next((out / "repo").glob("*.tar"))), shardshuffle=False)
    ]
    texts = {d["origin"]["path"]: d["segments"][0]["text"] for d in docs}
    assert texts == {
        "legacy.py": "# -*- coding: latin-1 -*-\nNAME = 'caf\u00e9'\n",
        "windows.c": "int caf\u00e9 = 1;\n",
    }


def test_image_and_video_tables(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes())
    (tmp_path / "t.csv").write_text(
        "image,caption,label\nimg/a.png,a red box,3\nimg/b.png,gone,4\nhttp://x/y.jpg,remote,5\n"
    )
    (tmp_path / "ids.jsonl").write_text(
        '{"image": "img/a.png", "id": "x1"}\n{"image": "img/a.png", "id": "x1"}\n'
        '{"image": "img/a.png", "id": "../up"}\n'
    )
    out = tmp_path / "out"
    s = ingest(out, [f"images:{tmp_path / 't.csv'}", f"images:{tmp_path / 'ids.jsonl'}"])
    assert s["manifest"]["totals"]["samples"] == 2
    assert sorted(_rejects(out).values()) == [
        "duplicate-key",
        "missing-media",
        "missing-media",
        "unsafe-name",
    ]


def test_a_caption_is_the_same_text_from_a_sidecar_and_from_a_table(tmp_path):
    """A sidecar .txt ends in a newline (echo, any editor), a table's cell does not: the model
    learned photo captions ending in one and table captions not, and generate printed it."""
    import webdataset as wds

    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("a.png", "b.png"):
        (pics / name).write_bytes(png_bytes())
    (pics / "a.txt").write_text("  a red box\n")
    (pics / "captions.csv").write_text("file,caption\nb.png,a red box\n")
    out = tmp_path / "out"
    ingest(out, [f"images:{pics}"])
    docs = [json.loads(x["json"]) for x in wds.WebDataset(str(next(out.rglob("*.tar"))))]
    assert [d["segments"][1]["text"] for d in docs] == ["a red box", "a red box"]


def test_repair_utf8_keeps_text_and_counts(tmp_path):
    from data.sources import Limits

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "l1.txt").write_bytes("caf\xe9".encode("latin-1"))
    s = ingest(tmp_path / "out", [f"text:{tmp_path / 't'}"], limits=Limits(repair_utf8=True))
    assert s["manifest"]["totals"]["samples"] == 1 and s["manifest"]["totals"]["repaired_utf8"] == 1


def test_repair_utf8_keeps_table_rows_too(tmp_path):
    """A Latin-1 row of a CSV or JSONL table was a not-utf8 reject whatever --repair-utf8 said."""
    from data.sources import Limits

    for name in ("a", "b"):
        (tmp_path / f"{name}.png").write_bytes(png_bytes())
    latin = "caf\xe9".encode("latin-1")
    (tmp_path / "caps.csv").write_bytes(b"image,caption\na.png,a " + latin + b"\nb.png,plain\n")
    # the byte order mark Windows editors write first: still read, repaired or not
    (tmp_path / "t.jsonl").write_bytes(
        b'\xef\xbb\xbf{"text": "au ' + latin + b'"}\n{"text": "plain"}\n'
    )
    sources = [f"images:{tmp_path / 'caps.csv'}", f"text:{tmp_path / 't.jsonl'}"]
    refused = ingest(tmp_path / "strict", sources)
    assert refused["manifest"]["totals"]["samples"] == 2
    assert sorted(_rejects(tmp_path / "strict").values()) == ["not-utf8", "not-utf8"]
    s = ingest(tmp_path / "out", sources, limits=Limits(repair_utf8=True))
    assert s["manifest"]["totals"]["samples"] == 4 and not _rejects(tmp_path / "out")


def test_names_that_are_not_utf8_are_rejects_naming_their_bytes(tmp_path):
    """A file or folder named in another encoding (a Latin-1 résumé.txt from an old zip) and a
    webdataset member likewise are unsafe-name rejects showing the bytes as \\xNN; the other
    inputs are ingested: one such name must not stop the ingest (its name cannot be stored as
    UTF-8 JSON)."""
    import io
    import os
    import tarfile

    code, notes, tars = tmp_path / "code", tmp_path / "notes", tmp_path / "wds"
    for folder in (code, notes, tars):
        folder.mkdir()
    (code / "ok.py").write_text("x = 1\n")
    os.mkdir(os.path.join(bytes(code), b"d\xe9r"))
    (Path(os.fsdecode(os.path.join(bytes(code), b"d\xe9r"))) / "in.py").write_text("y = 2\n")
    Path(os.fsdecode(os.path.join(bytes(notes), b"r\xe9sum\xe9.txt"))).write_text("my resume\n")
    (notes / "plain.txt").write_text("plain notes\n")
    with tarfile.open(tars / "a.tar", "w", encoding="utf-8", errors="surrogateescape") as tar:
        for name, data in ((os.fsdecode(b"k\xff.png"), png_bytes()), ("good.png", png_bytes())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    s = ingest(out, [f"code:{code}", f"text:{notes}", f"wds:{tars}"])
    assert _rejects(out) == {
        "d\\xe9r/": "unsafe-name",
        "r\\xe9sum\\xe9.txt": "unsafe-name",
        "a.tar:k\\xff": "unsafe-name",
    }
    assert s["manifest"]["totals"]["samples"] == 3
    assert "convmv" in (out / "rejects.jsonl").read_text()
    # a source folder so named: refused whole, before anything is written (the command line is
    # recorded with the shards)
    bad_source = os.fsdecode(os.path.join(bytes(code), b"d\xe9r"))
    argv = ["ingest", "--out", str(tmp_path / "o2"), "--source", f"text:{bad_source}"]
    assert main(argv) == 2 and not (tmp_path / "o2").exists()


def test_a_broken_or_looping_caption_link_rejects_its_picture(tmp_path):
    """a.txt -> gone.txt and b.txt -> b.txt cannot be read, as a caption without permission:
    each picture is an unreadable-file reject naming its sidecar, not a picture kept as if
    uncaptioned with its link in neither the shards nor the rejects."""
    pics = tmp_path / "pics"
    pics.mkdir()
    for name in "abc":
        (pics / f"{name}.png").write_bytes(png_bytes())
    (pics / "a.txt").symlink_to("gone.txt")
    (pics / "b.txt").symlink_to("b.txt")
    (pics / "c.txt").write_text("a caption")
    out = tmp_path / "out"
    s = ingest(out, [f"images:{pics}"])
    assert _rejects(out) == {"a.png": "unreadable-file", "b.png": "unreadable-file"}
    assert s["manifest"]["totals"]["samples"] == 1
    details = (out / "rejects.jsonl").read_text()
    assert "its sidecar a.txt: cannot stat it" in details and "its sidecar b.txt" in details


def test_a_folder_that_cannot_be_listed_is_a_reject(tmp_path):
    """A subfolder without read permission (a teammate's, on shared storage): one reject naming
    it, the rest ingested; the source's own folder so: a user error naming it. Root reads every
    folder, so as root the ingest runs without that privilege (setpriv)."""
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    (src / "locked" / "in.py").write_text("x = 1\n")
    (src / "a.py").write_text("y = 2\n")
    (src / "locked").chmod(0)
    unprivileged: list[str] = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root reads every folder, and setpriv is not here to drop that")
        drop = "-dac_override,-dac_read_search"
        unprivileged = ["setpriv", "--inh-caps", drop, "--bounding-set", drop, "--"]
    probe = [*unprivileged, sys.executable, "-c", f"import os; os.listdir({str(src / 'locked')!r})"]

    def ingest_as_user(source: Path, out: Path) -> subprocess.CompletedProcess:
        cmd = [*unprivileged, sys.executable, "-m", "data.cli", "ingest", "--out", str(out)]
        cmd += ["--no-progress", "--source", f"code:{source}"]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[2])

    try:
        if subprocess.run(probe, capture_output=True).returncode == 0:
            pytest.skip("this machine's root keeps reading the folder under setpriv")
        done = ingest_as_user(src, tmp_path / "out")
        whole = ingest_as_user(src / "locked", tmp_path / "out2")
    finally:
        (src / "locked").chmod(0o755)
    assert done.returncode == 3, done.stderr
    assert _rejects(tmp_path / "out") == {"locked/": "unreadable-file"}
    assert "cannot be listed: Permission denied" in (tmp_path / "out" / "rejects.jsonl").read_text()
    assert whole.returncode == 2 and "locked: the folder cannot be listed" in whole.stderr


def test_a_binary_file_under_a_text_name_is_rejected_in_text_folders_too(tmp_path):
    """A blob named .txt in a text folder is binary-file, as in a code tree, and UTF-16 without
    a byte order mark is named as such; UTF-16 or UTF-32 with their mark are text. A caption
    sidecar is checked too (NULs between its letters were kept as its caption)."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "blob.txt").write_bytes(b"abc\x00\x01\x02def" * 10)
    (notes / "unmarked.txt").write_bytes("wide notes\n".encode("utf-16-le"))
    (notes / "wide.txt").write_bytes("wide notes\n".encode("utf-16"))
    (notes / "wider.txt").write_bytes("wider notes\n".encode("utf-32"))
    (notes / "plain.txt").write_text("plain notes\n")
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "a.txt").write_bytes("a red square".encode("utf-16-le"))
    out = tmp_path / "out"
    s = ingest(out, [f"text:{notes}", f"images:{pics}"])
    assert _rejects(out) == {
        "blob.txt": "binary-file",
        "unmarked.txt": "binary-file",
        "a.png": "binary-file",
    }
    details = [json.loads(x)["detail"] for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted(details) == [
        "NUL byte in the first 8 KiB",
        "NUL bytes between the letters: UTF-16 without a byte order mark? save it as UTF-8",
        "its sidecar a.txt: NUL bytes between the letters: UTF-16 without a byte order mark? "
        "save it as UTF-8",
    ]
    assert s["manifest"]["totals"]["samples"] == 3
    texts = []
    for shard in out.rglob("*.tar"):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                doc = json.load(tar.extractfile(member)) if member.name.endswith(".json") else {}
                texts += [seg["text"] for seg in doc.get("segments", [])]
    assert sorted(texts) == ["plain notes\n", "wide notes\n", "wider notes\n"]


def test_the_text_limit_holds_for_a_table_row_a_jsonl_line_and_a_page(tmp_path):
    """--max-text-bytes held for files only: a 200 MB JSONL line was kept, and the BPE trainer
    took 8.6 GB on it. Every document's text is measured, however it came."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data.sources import Limits

    long = "word " * 500
    (tmp_path / "t.jsonl").write_text(
        json.dumps({"text": "short"}) + "\n" + json.dumps({"text": long}) + "\n"
    )
    pages = {"texts": [long[:1500], long[:1500], "end"], "images": [None, None, None]}
    (tmp_path / "p.jsonl").write_text(json.dumps(pages) + "\n")
    pq.write_table(pa.table({"text": ["short", long]}), tmp_path / "r.parquet")
    sources = [
        f"lines=text:{tmp_path / 't.jsonl'}",
        f"rows=text:{tmp_path / 'r.parquet'}",
        f"pages=interleaved:{tmp_path / 'p.jsonl'}",
    ]
    s = ingest(tmp_path / "out", sources, limits=Limits(max_text_bytes=2000))
    assert s["manifest"]["totals"]["samples"] == 2
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert {(r["path"], r["reason"], r["detail"]) for r in rejects} == {
        ("t.jsonl:2", "too-large", "2500 B of text > limit 2000 B (--max-text-bytes)"),
        ("r.parquet:row 1", "too-large", "2500 B of text > limit 2000 B (--max-text-bytes)"),
        ("p.jsonl:1", "too-large", "3000 B of text > limit 2000 B (--max-text-bytes)"),
    }


def test_a_caption_that_is_an_object_or_a_list_is_a_bad_record(tmp_path):
    """A sidecar's {"caption": {"en": ...}} or a table's struct caption was trained on as its
    Python repr ("{'en': 'nested'}"); a number is still taken as its text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("a", "b", "c"):
        (pics / f"{name}.png").write_bytes(png_bytes())
    (pics / "a.json").write_text('{"caption": {"en": "nested"}}')
    (pics / "b.json").write_text('{"caption": ["one", "two"]}')
    (pics / "c.json").write_text('{"caption": 42}')
    pq.write_table(
        pa.table({"image": [png_bytes()], "caption": [{"en": "x"}]}), tmp_path / "t.parquet"
    )
    s = ingest(tmp_path / "out", [f"images:{pics}", f"rows=images:{tmp_path / 't.parquet'}"])
    assert s["manifest"]["totals"]["samples"] == 1
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert {(r["path"], r["reason"], r["detail"]) for r in rejects} == {
        ("a.png", "bad-record", 'its caption is an object ({"en": "nested"}), not text'),
        ("b.png", "bad-record", 'its caption is a list (["one", "two"]), not text'),
        ("t.parquet:row 0", "bad-record", 'its caption is an object ({"en": "x"}), not text'),
    }


def test_a_notebook_is_named_with_what_to_do_and_a_stereo_photo_is_not_animated(tmp_path):
    from PIL import Image

    from data.media import probe_image

    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("A = 1\n")
    (code / "nb.ipynb").write_text('{"cells": []}')
    ingest(tmp_path / "out", [f"code:{code}"])
    (reject,) = [
        json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    ]
    assert reject["reason"] == "unknown-type" and "jupytext --to py" in reject["detail"]
    # An MPO (a phone's stereo or depth JPEG) holds two frames that are no animation
    left, right = Image.new("RGB", (16, 16), "red"), Image.new("RGB", (16, 16), "blue")
    buf = io.BytesIO()
    left.save(buf, format="MPO", save_all=True, append_images=[right])
    info = probe_image(buf.getvalue(), "stereo.jpg", max_pixels=10**6)
    assert info.format == "MPO" and info.animation_frames == 1


def test_a_webdataset_key_with_dots_keeps_its_caption_and_an_object_caption_is_refused(tmp_path):
    """webdataset's key ends at the first dot: a.b.jpg and a.b.txt are key "a", members "b.jpg"
    and "b.txt". The picture was read by its last extension and the caption dropped."""
    from factories import write_wds

    shards = tmp_path / "wds"
    shards.mkdir()
    write_wds(
        shards / "s.tar",
        [
            ("img.v2", {"jpg": png_bytes(), "txt": b"a caption after a dotted key"}),
            ("pic.v3", {"jpg": png_bytes(), "json": b'{"caption": "from its json", "by": "me"}'}),
            ("obj", {"jpg": png_bytes(), "json": b'{"caption": {"en": "x"}}'}),
        ],
    )
    ingest(tmp_path / "out", [f"wds:{shards}"])
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in rejects] == [("s.tar:obj", "bad-record")]
    from data.shards.reader import iter_shard, shard_entries

    out = tmp_path / "out"
    docs = [d for tar, index, _ in shard_entries(out) for d in iter_shard(tar, index)]
    texts = [[s["text"] for s in d.doc["segments"] if s["type"] == "text"] for d in docs]
    assert texts == [["a caption after a dotted key"], ["from its json"]]
    assert docs[1].doc["meta"] == {"by": "me"}
