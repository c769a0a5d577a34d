"""The shard-job state and files of a folder, read the same way here and in object storage
(fsspec's in-memory filesystem: a real backend, no server)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import fsspec
import pytest

from data.shards.manifest import record_path
from data.shards.storage import Folder, Staging


@pytest.fixture(params=["local", "memory"])
def folder(request, tmp_path):
    if request.param == "local":
        yield Folder(tmp_path / "out")
        return
    remote = Folder(f"memory://storage-{tmp_path.name}")
    yield remote
    if remote.fs.exists(remote.root):
        remote.fs.rm(remote.root, recursive=True)


def test_records_skip_what_a_kill_or_another_job_left(folder):
    folder.write_json(record_path(0), {"index": 0, "tar": "a.tar"})
    folder.write_json(record_path(1), [1])  # JSON, but not a record: skipped like a cut one
    folder.write_json(record_path(2, ".tokenize"), {"index": 2})  # another job's state
    fs, root = fsspec.core.url_to_fs(folder.url)
    fs.pipe_file(f"{root}/{record_path(3)}", b'{"index": 3, "ta')  # cut short by a kill
    assert folder.records(".ingest") == {0: {"index": 0, "tar": "a.tar"}}
    assert folder.records(".tokenize") == {2: {"index": 2}}


def test_download_names_a_missing_file(folder, tmp_path):
    folder.write_json("a/b.json", {"x": 1})
    copy = folder.download("a/b.json", tmp_path / "copy" / "b.json")
    assert copy.read_bytes() == folder.read_bytes("a/b.json") == b'{\n "x": 1\n}\n'
    with pytest.raises(FileNotFoundError, match=re.escape(f"{folder.child('a/c.tar')} does not")):
        folder.download("a/c.tar", tmp_path / "copy" / "c.tar")


def test_a_local_listing_follows_links_to_folders_once(tmp_path, tiny_tokens):
    """A folder of links to the sources to evaluate is listed through its links, and a link back
    up does not loop; earlyfuse-eval --data takes such a folder, or one link, as the sources."""
    from data.token_docs import source_tables

    picked = tmp_path / "picked"
    picked.mkdir()
    (picked / "code").symlink_to(tiny_tokens / "code")
    (picked / "loop").symlink_to(picked)
    listed = Folder(picked).sizes()
    assert any(name.startswith("code/") and name.endswith(".tar") for name in listed)
    assert not any(name.startswith("loop/") for name in listed)
    (picked / "loop").unlink()
    tables = source_tables(picked)
    assert [(t.name, len(t)) for t in tables] == [
        ("code", len(source_tables(tiny_tokens / "code")[0]))
    ]
    assert [t.name for t in source_tables(picked / "code")] == ["code"]


def test_a_new_stage_removes_what_a_killed_job_staged(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    killed = tmp_path / f"earlyfuse-stage-{gone.pid}-x1y2z3w4"
    (killed / "shards").mkdir(parents=True)
    (killed / "shards" / "part-00000.tar").write_bytes(b"staged, never uploaded")
    running = tmp_path / f"earlyfuse-inputs-{os.getpid()}-a1b2c3d4"  # a live job's: kept
    running.mkdir()
    other = tmp_path / "earlyfuse-shards-1000"  # the loader's cache: not a job's temp folder
    other.mkdir()
    mine = tmp_path / f"earlyfuse-run-{gone.pid}-abcdefgh"  # a user's, named alike: not ours
    mine.mkdir()
    with Staging(Folder("memory://staging-test")) as stage:
        assert stage.tmp is not None and stage.tmp.name.startswith(
            f"earlyfuse-stage-{os.getpid()}-"
        )
        assert not killed.exists() and running.is_dir() and other.is_dir() and mine.is_dir()
        staged = stage.tmp
    assert not staged.exists()


def test_files_written_together_replace_theirs_all_or_none(tmp_path, monkeypatch):
    """A write that fails on the last file (a full disk) leaves every old file as it was, the
    ones written before it too, and no temporary file; the error names the file."""
    import errno

    from data.shards import storage

    paths = [tmp_path / name for name in ("a.png", "b.png", "c.html")]
    for path in paths:
        path.write_bytes(b"old " + path.name.encode())
    synced = []

    def full_at_the_third(fd: int) -> None:
        synced.append(fd)
        if len(synced) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage.os, "fsync", full_at_the_third)
    with pytest.raises(OSError) as failed:
        storage.write_all_atomic({path: b"new" for path in paths})
    assert failed.value.filename == str(paths[2]) and failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png", "c.html"]
    assert [p.read_bytes() for p in paths] == [b"old a.png", b"old b.png", b"old c.html"]
    monkeypatch.undo()
    storage.write_all_atomic({path: b"new" for path in paths})
    assert [p.read_bytes() for p in paths] == [b"new"] * 3
