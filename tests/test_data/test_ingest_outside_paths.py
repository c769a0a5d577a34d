"""A table that names media by path may only name files inside its own folder: a path whose
``..`` lead out of it, or an absolute path outside it, is rejected as ``outside-tree`` unless
``--allow-outside-paths`` is given. Before: JSONL/CSV/parquet rows with
``../../outside/outside.png`` or an absolute path were ingested byte for byte. Every kind of
table that reads paths is checked: image JSONL and CSV tables, interleaved JSONL (OBELICS lists
and native segments), and parquet tables (a path column, a Hugging Face ``Image()`` struct,
OBELICS lists)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import mp4_bytes, png_bytes

from data.cli import EXIT_REJECTS, main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture()
def tables(tmp_path) -> dict:
    """Files outside (tmp/outside/) and tables in tmp/src/table/ naming them, beside rows that
    stay inside (one of them through a harmless ``..``)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "outside.png").write_bytes(png_bytes(24, 16, (1, 2, 3)))
    (outside / "outside.mp4").write_bytes(mp4_bytes(frames=6))
    table = tmp_path / "src" / "table"
    (table / "img").mkdir(parents=True)
    (table / "img" / "ok.png").write_bytes(png_bytes())
    up, absolute = "../../outside/outside.png", str(outside / "outside.png")
    rows = [
        ("img/ok.png", "inside"),
        ("img/../img/ok.png", "inside too"),
        (up, "up"),
        (absolute, "abs"),
    ]
    (table / "caps.jsonl").write_text(
        "".join(json.dumps({"image": path, "caption": cap}) + "\n" for path, cap in rows)
    )
    (table / "caps.csv").write_text(
        "image,caption\n" + "".join(f"{path},{cap}\n" for path, cap in rows)
    )
    (table / "docs.jsonl").write_text(
        json.dumps({"texts": ["fine", None], "images": [None, "img/ok.png"]})
        + "\n"
        + json.dumps({"texts": ["up", None], "images": [None, up]})
        + "\n"
        + json.dumps({"segments": [{"type": "video", "path": str(outside / "outside.mp4")}]})
        + "\n"
    )
    pq.write_table(
        pa.table({"image": [path for path, _ in rows], "caption": [cap for _, cap in rows]}),
        table / "paths.parquet",
    )
    struct = [{"bytes": None, "path": path} for path, _ in rows]
    pq.write_table(pa.table({"image": struct}), table / "structs.parquet")
    pq.write_table(
        pa.table(
            {"texts": [["a", None], ["b", None]], "images": [[None, "img/ok.png"], [None, up]]}
        ),
        table / "obelics.parquet",
    )
    sources = [
        f"jsonl=images:{table / 'caps.jsonl'}",
        f"csv=images:{table / 'caps.csv'}",
        f"docs=interleaved:{table / 'docs.jsonl'}",
        f"paths=images:{table / 'paths.parquet'}",
        f"structs=images:{table / 'structs.parquet'}",
        f"obelics=interleaved:{table / 'obelics.parquet'}",
    ]
    return {"outside": outside, "table": table, "sources": sources, "up": up, "abs": absolute}


def run_ingest(out: Path, sources: list[str], *flags: str) -> int:
    argv = ["ingest", "--out", str(out), "--no-progress", *flags]
    for source in sources:
        argv += ["--source", source]
    return main(argv)


def shard_bytes(out: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(out.rglob("*.tar")))


def test_paths_leaving_the_tables_folder_are_rejected(tables, tmp_path):
    out = tmp_path / "shards"
    assert run_ingest(out, tables["sources"]) == EXIT_REJECTS
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["reason"] for r in rejects} == {"outside-tree"}
    up, absolute = tables["up"], tables["abs"]
    assert {(r["source"], r["path"]) for r in rejects} == {
        ("jsonl", f"caps.jsonl:3 ({up})"),
        ("jsonl", f"caps.jsonl:4 ({absolute})"),
        ("csv", f"caps.csv:4 ({up})"),
        ("csv", f"caps.csv:5 ({absolute})"),
        ("docs", "docs.jsonl:2"),
        ("docs", "docs.jsonl:3"),
        ("paths", f"paths.parquet:row 2 ({up})"),
        ("paths", f"paths.parquet:row 3 ({absolute})"),
        ("structs", f"structs.parquet:row 2 ({up})"),
        ("structs", f"structs.parquet:row 3 ({absolute})"),
        ("obelics", f"obelics.parquet:row 1 ({up})"),
    }
    for reject in rejects:
        assert str(tables["table"]) in reject["detail"]
        assert "--allow-outside-paths" in reject["detail"]
        # how the path leads out, as the table wrote it (a '..' row is no absolute path)
        written_up = up in reject["path"] or reject["path"] == "docs.jsonl:2"
        how = "a path whose '..' lead" if written_up else "an absolute path"
        assert how in reject["detail"], reject
    data = shard_bytes(out)
    for name in ("outside.png", "outside.mp4"):
        assert (tables["outside"] / name).read_bytes() not in data
    per = {
        s["name"]: s["samples"] for s in json.loads((out / "manifest.json").read_text())["sources"]
    }
    assert per == {"jsonl": 2, "csv": 2, "docs": 1, "paths": 2, "structs": 2, "obelics": 1}


def test_allow_outside_paths_reads_them(tables, tmp_path, capsys):
    out = tmp_path / "shards"
    assert run_ingest(out, tables["sources"], "--allow-outside-paths") == 0
    assert "rejected: none" in capsys.readouterr().out
    data = shard_bytes(out)
    for name in ("outside.png", "outside.mp4"):
        assert (tables["outside"] / name).read_bytes() in data
