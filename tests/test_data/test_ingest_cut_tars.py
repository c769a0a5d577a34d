"""A webdataset input tar cut short, wherever the cut falls, is reported at ingest: the tar named,
the reason ``truncated-tar`` (or ``corrupt-tar`` for a damaged header with data after it), and
what was lost. Before: a cut inside a member's 512-byte header ended the listing silently (rc 0,
"rejected: none"), because Python's tarfile takes a short or bad header after the first member
for the end of the archive; and a sample whose members straddled the cut was kept without them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from factories import jpeg_bytes, write_wds

from data.cli import EXIT_REJECTS, main


def five_samples(path: Path) -> dict[str, int]:
    """A 5-sample tar (s0..s4, each a jpg and a caption); the header offset of every member."""
    write_wds(
        path,
        [(f"s{n}", {"jpg": jpeg_bytes(seed=n), "txt": f"caption {n}".encode()}) for n in range(5)],
    )
    with tarfile.open(path) as archive:
        return {member.name: member.offset for member in archive.getmembers()}


def ingest_cut(tmp_path: Path, cut_at: int) -> tuple[int, list[dict], dict]:
    tar = tmp_path / "in" / "cut.tar"
    tar.write_bytes(tar.read_bytes()[:cut_at])
    out = tmp_path / "out"
    status = main(["ingest", "--out", str(out), "--no-progress", "--source", f"wds:{tar.parent}"])
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    return status, rejects, json.loads((out / "manifest.json").read_text())


@pytest.fixture()
def offsets(tmp_path) -> dict[str, int]:
    (tmp_path / "in").mkdir()
    return five_samples(tmp_path / "in" / "cut.tar")


def test_a_cut_inside_a_member_header_is_reported(tmp_path, offsets, capsys):
    # Inside the header of sample 3's first member, past its name field: the name is readable.
    status, rejects, manifest = ingest_cut(tmp_path, offsets["s3.jpg"] + 300)
    assert status == EXIT_REJECTS
    assert "rejected 1 input(s)" in capsys.readouterr().out
    assert manifest["totals"]["samples"] == 3
    (reject,) = rejects
    assert (reject["path"], reject["reason"]) == ("cut.tar", "truncated-tar")
    detail = reject["detail"]
    assert "inside the header of member 's3.jpg'" in detail
    assert f"byte {offsets['s3.jpg'] + 300}" in detail
    assert "sample 's3' and every sample after it are lost" in detail
    assert "3 sample(s) before it are kept" in detail


def test_a_cut_inside_the_name_of_a_header_leaves_out_the_sample_it_may_belong_to(
    tmp_path, offsets
):
    # Only "s" of "s3.jpg" is there: the member may have been s2's, so s2 is not kept without it.
    status, rejects, manifest = ingest_cut(tmp_path, offsets["s3.jpg"] + 1)
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 2
    (reject,) = rejects
    assert reject["reason"] == "truncated-tar"
    assert "sample 's2' may be incomplete and is left out" in reject["detail"]


def test_a_sample_cut_between_its_members_is_left_out_and_named(tmp_path, offsets):
    # Inside the data of s3's caption: s3's image is complete but the sample is not.
    status, rejects, manifest = ingest_cut(tmp_path, offsets["s3.txt"] + 512 + 3)
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 3
    (reject,) = rejects
    assert reject["reason"] == "truncated-tar"
    assert "ends inside member 's3.txt'" in reject["detail"]
    assert "sample 's3' and every sample after it are lost" in reject["detail"]


def test_a_cut_on_a_member_boundary_is_reported(tmp_path, offsets):
    # Exactly where s3's first header would start: no end-of-archive blocks follow.
    status, rejects, manifest = ingest_cut(tmp_path, offsets["s3.jpg"])
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 2
    (reject,) = rejects
    assert reject["reason"] == "truncated-tar"
    assert "without the end-of-archive blocks" in reject["detail"]


def test_a_damaged_header_with_data_after_it_is_reported(tmp_path, offsets):
    tar = tmp_path / "in" / "cut.tar"
    data = bytearray(tar.read_bytes())
    data[offsets["s3.jpg"] + 148 : offsets["s3.jpg"] + 156] = b"garbage!"  # its checksum
    tar.write_bytes(bytes(data))
    status, rejects, manifest = ingest_cut(tmp_path, len(data))
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 3
    (reject,) = rejects
    assert reject["reason"] == "corrupt-tar"
    assert f"byte {offsets['s3.jpg']}" in reject["detail"]
    assert "sample 's3' and every sample after it are lost" in reject["detail"]


def test_a_whole_tar_and_its_end_padding_give_no_reject(tmp_path, offsets, capsys):
    tar = tmp_path / "in" / "cut.tar"
    status, rejects, manifest = ingest_cut(tmp_path, tar.stat().st_size)
    assert status == 0 and rejects == [] and manifest["totals"]["samples"] == 5
    assert "rejected: none" in capsys.readouterr().out


def test_a_second_archive_appended_after_the_end_blocks_is_reported(tmp_path, offsets):
    tar = tmp_path / "in" / "cut.tar"
    five_samples(tmp_path / "second.tar")
    tar.write_bytes(tar.read_bytes() + (tmp_path / "second.tar").read_bytes())
    status, rejects, manifest = ingest_cut(tmp_path, tar.stat().st_size)
    assert status == EXIT_REJECTS and manifest["totals"]["samples"] == 5
    (reject,) = rejects
    assert reject["reason"] == "corrupt-tar"
    assert "data after its end-of-archive blocks" in reject["detail"]


def test_a_sample_without_media_names_its_members(tmp_path):
    """A webdataset sample of a caption and a member without an extension: missing-media, its
    members named (an extensionless one by its whole name, not an empty pair of brackets)."""
    (tmp_path / "in").mkdir()
    write_wds(tmp_path / "in" / "a.tar", [("s0", {"txt": b"a caption"}), ("s1", {"": b"raw"})])
    out = tmp_path / "out"
    assert (
        main(["ingest", "--out", str(out), "--no-progress", "--source", f"wds:{tmp_path / 'in'}"])
        == 3
    )
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["detail"]) for r in rejects] == [
        ("missing-media", "no image or video member (its members: s0.txt)"),
        ("missing-media", "no image or video member (its members: s1)"),
    ]


def test_a_member_twice_or_a_key_split_apart_is_a_reject_that_says_so(tmp_path):
    """tar -r appends a second s0.jpg (webdataset refuses such a tar; one copy would be lost
    unsaid); s1's caption after s2's members is a second s1 that webdataset reads apart."""
    (tmp_path / "in").mkdir()
    with tarfile.open(tmp_path / "in" / "a.tar", "w") as tar:
        for name, data in [
            ("s0.jpg", jpeg_bytes(seed=1)),
            ("s0.jpg", jpeg_bytes(seed=2)),
            ("s1.jpg", jpeg_bytes(seed=3)),
            ("s2.jpg", jpeg_bytes(seed=4)),
            ("s1.txt", b"the caption of s1"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    argv = ["ingest", "--out", str(out), "--no-progress", "--source", f"wds:{tmp_path / 'in'}"]
    assert main(argv) == EXIT_REJECTS
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in rejects] == [
        ("a.tar:s0", "duplicate-key"),
        ("a.tar:s1", "duplicate-key"),
    ]
    assert (
        rejects[0]["detail"] == "s0.jpg appears twice in the tar (appended with tar -r?): keep one"
    )
    assert "members of s1 (s1.txt) come after other keys' members" in rejects[1]["detail"]


def test_a_file_that_is_no_tar_is_corrupt_not_truncated(tmp_path):
    """Text or random bytes named .tar are no archive cut short: corrupt-tar, nothing read."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "notes.tar").write_bytes(b"hello world\n" * 100)
    out = tmp_path / "out"
    assert (
        main(["ingest", "--out", str(out), "--no-progress", "--source", f"wds:{tmp_path / 'in'}"])
        == 3
    )
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["reason"], reject["detail"]) == (
        "corrupt-tar",
        "not a tar archive (invalid header): nothing in it is read",
    )


def test_a_sample_with_a_link_member_is_named_not_said_to_lack_media(tmp_path):
    """A tar made without --dereference stores a symlinked picture as a link member, which holds
    no bytes: its sample is unreadable-file naming the member (it was missing-media, "its
    members: s0.txt", and a sample of links alone vanished unlisted)."""
    (tmp_path / "in").mkdir()
    with tarfile.open(tmp_path / "in" / "a.tar", "w") as tar:
        for name, target in [("s0.jpg", "elsewhere.jpg"), ("s0.txt", ""), ("s1.png", "s0.jpg")]:
            member = tarfile.TarInfo(name)
            if target:
                member.type, member.linkname = tarfile.SYMTYPE, target
                tar.addfile(member)
            else:
                member.size = 9
                tar.addfile(member, io.BytesIO(b"a caption"))
    out = tmp_path / "out"
    assert (
        main(["ingest", "--out", str(out), "--no-progress", "--source", f"wds:{tmp_path / 'in'}"])
        == 3
    )
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    link = "a link (or device) member, not a file: it holds no bytes"
    assert [(r["path"], r["reason"], r["detail"].split(" (write")[0]) for r in rejects] == [
        ("a.tar:s0", "unreadable-file", f"s0.jpg: {link}"),
        ("a.tar:s1", "unreadable-file", f"s1.png: {link}"),
    ]
