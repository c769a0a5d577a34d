"""Ingest never follows a symlink out of a source's folder. Before: a link
``code/pkg/x.py -> /etc/passwd`` put /etc/passwd into the shards. Each kind gets real symlinks
to real files outside its folder (a secret text file, a valid PNG and a valid mp4 that ingest
would otherwise take): every one is rejected as ``link-outside-source`` and nothing of it
reaches a shard; links inside the folder are followed; ``--follow-links-outside`` reads them."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from factories import mp4_bytes, png_bytes, write_wds

from data.cli import EXIT_REJECTS, main
from data.ingest import ingest
from data.sources import Limits

SECRET = "root:x:0:0:the secret stand-in for /etc/passwd:/root:/bin/bash\n"


@pytest.fixture()
def world(tmp_path) -> dict:
    """Outside files (a secret, an image, a video, a tar) and one source per kind holding links
    to them, next to an ordinary file and a link that stays inside."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "passwd").write_text(SECRET)
    (out / "secret.png").write_bytes(png_bytes(24, 16, (1, 2, 3)))
    (out / "secret.mp4").write_bytes(mp4_bytes(frames=6))
    (out / "pkg").mkdir()
    (out / "pkg" / "leak.py").write_text("SECRET = 'outside'\n")
    write_wds(out / "secret.tar", [("s0", {"jpg": png_bytes(8, 8), "txt": b"outside"})])

    src = tmp_path / "src"
    code = src / "code" / "pkg"
    code.mkdir(parents=True)
    (code / "ok.py").write_text("def ok():\n    return 1\n")
    (code / "x.py").symlink_to(out / "passwd")
    (code / "inside.py").symlink_to(code / "ok.py")  # a link inside the folder: fine
    (src / "code" / "vendor_link").symlink_to(out / "pkg", target_is_directory=True)

    text = src / "text"
    text.mkdir()
    (text / "ok.txt").write_text("An ordinary paragraph of prose.\n")
    (text / "notes.txt").symlink_to(out / "passwd")

    images = src / "images"
    images.mkdir()
    (images / "ok.png").write_bytes(png_bytes())
    (images / "ok.txt").write_text("an ordinary caption")
    (images / "leak.png").symlink_to(out / "secret.png")
    (images / "cap.png").write_bytes(png_bytes(16, 16))
    (images / "cap.txt").symlink_to(out / "passwd")  # a sidecar caption leading out

    videos = src / "videos"
    videos.mkdir()
    (videos / "ok.mp4").write_bytes(mp4_bytes())
    (videos / "leak.mp4").symlink_to(out / "secret.mp4")

    table = src / "table"
    (table / "img").mkdir(parents=True)
    (table / "img" / "ok.png").write_bytes(png_bytes())
    (table / "img" / "leak.png").symlink_to(out / "secret.png")
    (table / "linked").symlink_to(out, target_is_directory=True)  # a folder leading out
    rows = [("img/ok.png", "ok"), ("img/leak.png", "leak"), ("linked/secret.png", "dir link")]
    (table / "caps.jsonl").write_text(
        "".join(json.dumps({"image": p, "caption": c}) + "\n" for p, c in rows)
    )
    (table / "caps.csv").write_text("image,caption\n" + "".join(f"{p},{c}\n" for p, c in rows))
    pq.write_table(  # a parquet table of paths (pyarrow is in the test extra)
        pa.table({"image": [p for p, _ in rows], "caption": [c for _, c in rows]}),
        table / "caps.parquet",
    )
    (table / "docs.jsonl").write_text(
        json.dumps({"texts": ["fine", None], "images": [None, "img/ok.png"]})
        + "\n"
        + json.dumps({"texts": ["leaks", None], "images": [None, "img/leak.png"]})
        + "\n"
        + json.dumps({"segments": [{"type": "video", "path": "linked/secret.mp4"}]})
        + "\n"
    )

    wds_dir = src / "wds"
    wds_dir.mkdir()
    write_wds(wds_dir / "ok.tar", [("a0", {"jpg": png_bytes(8, 8), "txt": b"inside"})])
    (wds_dir / "leak.tar").symlink_to(out / "secret.tar")
    return {"outside": out, "src": src}


def sources(src: Path) -> list[str]:
    return [
        f"code:{src / 'code'}",
        f"text:{src / 'text'}",
        f"images:{src / 'images'}",
        f"videos:{src / 'videos'}",
        f"tableimg=images:{src / 'table' / 'caps.jsonl'}",
        f"tablecsv=images:{src / 'table' / 'caps.csv'}",
        f"tablepq=images:{src / 'table' / 'caps.parquet'}",
        f"interleaved:{src / 'table' / 'docs.jsonl'}",
        f"wds:{src / 'wds'}",
    ]


def shard_bytes(out: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.rglob("*.tar")))


def test_links_out_of_every_kind_of_source_are_rejected(world, tmp_path, capsys):
    out = tmp_path / "shards"
    argv = ["ingest", "--out", str(out), "--no-progress"]
    for s in sources(world["src"]):
        argv += ["--source", s]
    assert main(argv) == EXIT_REJECTS
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    links = {(r["source"], r["path"]) for r in rejects if r["reason"] == "link-outside-source"}
    assert links == {
        ("code", "pkg/x.py"),
        ("code", "vendor_link/"),
        ("text", "notes.txt"),
        ("images", "leak.png"),
        ("images", "cap.png"),
        ("videos", "leak.mp4"),
        ("tableimg", "caps.jsonl:2 (img/leak.png)"),
        ("tableimg", "caps.jsonl:3 (linked/secret.png)"),
        ("tablecsv", "caps.csv:3 (img/leak.png)"),
        ("tablecsv", "caps.csv:4 (linked/secret.png)"),
        ("tablepq", "caps.parquet:row 1 (img/leak.png)"),
        ("tablepq", "caps.parquet:row 2 (linked/secret.png)"),
        ("docs", "docs.jsonl:2"),
        ("docs", "docs.jsonl:3"),
        ("wds", "leak.tar"),
    }
    assert all(str(world["outside"]) in r["detail"] for r in rejects if "link" in r["reason"])
    assert {r["reason"] for r in rejects} == {"link-outside-source"}
    data = shard_bytes(out)
    assert b"the secret stand-in" not in data and b"SECRET = 'outside'" not in data
    assert b"outside" not in data.replace(str(world["outside"]).encode(), b"")
    for name in ("secret.png", "secret.mp4"):
        assert (world["outside"] / name).read_bytes() not in data
    assert (world["src"] / "videos" / "ok.mp4").read_bytes() in data
    # What stayed inside was ingested, the inside link included.
    m = json.loads((out / "manifest.json").read_text())
    per = {s["name"]: s["samples"] for s in m["sources"]}
    assert per == {
        "code": 2,
        "text": 1,
        "images": 1,
        "videos": 1,
        "tableimg": 1,
        "tablecsv": 1,
        "tablepq": 1,
        "docs": 1,
        "wds": 1,
    }
    with tarfile.open(next((out / "code").glob("*.tar"))) as tf:
        assert {"code-pkg_inside_py.json", "code-pkg_ok_py.json"} <= set(tf.getnames())


def test_follow_links_outside_reads_them_when_asked(world, tmp_path):
    out = tmp_path / "shards"
    s = ingest(out, sources(world["src"]), limits=Limits(follow_links_outside=True))
    assert s["finalized"]
    reasons = [json.loads(x)["reason"] for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert "link-outside-source" not in reasons
    data = shard_bytes(out)
    assert b"the secret stand-in" in data and b"SECRET = 'outside'" in data
    assert (world["outside"] / "secret.mp4").read_bytes() in data


@pytest.mark.parametrize("follow", [False, True])
def test_a_symlink_loop_is_a_reject_naming_it_not_a_crash(tmp_path, follow):
    """A link to itself, two links to each other, in a source tree, a text folder, an image
    folder and under a table's media path: each is listed as unreadable-file saying it loops,
    whether or not links out are followed, and the files beside them are ingested."""
    src = tmp_path / "src"
    for kind in ("code", "text", "images", "table/img"):
        (src / kind).mkdir(parents=True)
    (src / "code" / "ok.py").write_text("x = 1\n")
    (src / "code" / "self.py").symlink_to("self.py")
    (src / "text" / "ok.txt").write_text("A paragraph.\n")
    (src / "text" / "a.txt").symlink_to("b.txt")
    (src / "text" / "b.txt").symlink_to("a.txt")
    (src / "images" / "ok.png").write_bytes(png_bytes())
    (src / "images" / "loop.png").symlink_to("loop.png")
    (src / "table" / "img" / "loop.png").symlink_to("loop.png")
    (src / "table" / "caps.jsonl").write_text('{"image": "img/loop.png", "caption": "x"}\n')
    out = tmp_path / "shards"
    argv = ["ingest", "--out", str(out), "--no-progress", *(["--follow-links-outside"] * follow)]
    for kind in ("code", "text", "images"):
        argv += ["--source", f"{kind}:{src / kind}"]
    argv += ["--source", f"table=images:{src / 'table' / 'caps.jsonl'}"]
    assert main(argv) == EXIT_REJECTS
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["source"], r["path"], r["reason"]) for r in rejects} == {
        ("code", "self.py", "unreadable-file"),
        ("text", "a.txt", "unreadable-file"),
        ("text", "b.txt", "unreadable-file"),
        ("images", "loop.png", "unreadable-file"),
        ("table", "caps.jsonl:1 (img/loop.png)", "unreadable-file"),
    }
    for r in rejects:
        assert "symlink loop" in r["detail"] or "Too many levels of symbolic links" in r["detail"]
    m = json.loads((out / "manifest.json").read_text())
    assert {s["name"]: s["samples"] for s in m["sources"]} == {
        "code": 1,
        "text": 1,
        "images": 1,
        "table": 0,
    }


def test_a_named_pipe_is_a_reject_never_opened(tmp_path, capsys, no_hang):
    """A FIFO in a folder, under a table's media path, in an interleaved page and as a source
    itself: opening one with no writer waits for ever (ingest hung with no word). Each is an
    unreadable-file reject naming what it is, or for a source, one line (exit 2)."""
    import os

    src = tmp_path / "src"
    for kind in ("code", "text", "images", "table/img"):
        (src / kind).mkdir(parents=True)
    (src / "code" / "ok.py").write_text("x = 1\n")
    (src / "images" / "ok.png").write_bytes(png_bytes())
    (src / "text" / "ok.txt").write_text("A paragraph.\n")
    for fifo in ("code/p.py", "text/p.txt", "images/p.png", "table/img/p.png", "pipe.jsonl"):
        os.mkfifo(src / fifo)
    (src / "table" / "caps.jsonl").write_text('{"image": "img/p.png", "caption": "x"}\n')
    (src / "table" / "pages.jsonl").write_text(
        '{"texts": ["a", null], "images": [null, "img/p.png"]}\n'
    )
    out = tmp_path / "shards"
    argv = ["ingest", "--out", str(out), "--no-progress"]
    for kind in ("code", "text", "images"):
        argv += ["--source", f"{kind}:{src / kind}"]
    argv += ["--source", f"table=images:{src / 'table' / 'caps.jsonl'}"]
    argv += ["--source", f"pages=interleaved:{src / 'table' / 'pages.jsonl'}"]
    assert main(argv) == EXIT_REJECTS
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["source"], r["path"], r["reason"]) for r in rejects} == {
        ("code", "p.py", "unreadable-file"),
        ("text", "p.txt", "unreadable-file"),
        ("images", "p.png", "unreadable-file"),
        ("table", "caps.jsonl:1 (img/p.png)", "unreadable-file"),
        ("pages", "pages.jsonl:1", "unreadable-file"),
    }
    assert all("not a regular file but a named pipe (FIFO)" in r["detail"] for r in rejects)
    argv = ["ingest", "--out", str(tmp_path / "b"), "--no-progress"]
    assert main([*argv, "--source", f"text:{src / 'pipe.jsonl'}"]) == 2
    assert "pipe.jsonl: not a regular file but a named pipe (FIFO)" in capsys.readouterr().err


def test_a_folder_link_inside_the_source_is_listed_and_its_files_read_once(tmp_path):
    """A symlink to a folder of the same source (a loop back to a parent among them) is not
    entered, so nothing is read twice or for ever, and it is listed (it was neither read nor
    listed), as lossless: the files it leads to are read where they are."""
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "a.py").write_text("A = 1\n")
    (code / "pkg" / "up").symlink_to("..", target_is_directory=True)
    (code / "same").symlink_to("pkg", target_is_directory=True)
    (code / ".cache" / "v1").mkdir(parents=True)
    (code / "cached").symlink_to(".cache/v1", target_is_directory=True)
    hidden = "hidden folder '.cache' skipped"
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"code:{code}"]) == 0
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {(r["path"], r["reason"], r["detail"]) for r in rejects} == {
        (".cache/", "vendored", hidden),
        ("cached/", "link-inside-source", "a symlink to .cache/v1/, not read: " + hidden),
        ("pkg/up/", "link-inside-source", "a symlink to the source folder, read there"),
        ("same/", "link-inside-source", "a symlink to pkg/, read there"),
    }
    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples"] == 1
