"""The commands' shared output rules (data/cli/common.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from data.cli.common import os_error_line
from data.shards.storage import write_folder


def test_a_replaced_folder_stays_until_the_new_one_is_in_its_place(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old")
    move = os.replace

    def fail_moving_in(src, dst):  # the last step: OUT.partial -> OUT
        if Path(src).name == "out.partial":
            raise OSError(errno.EIO, "Input/output error")
        move(src, dst)

    monkeypatch.setattr(os, "replace", fail_moving_in)
    with pytest.raises(OSError, match="Input/output"):
        write_folder(out, lambda folder: (folder / "a").write_text("new"))
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "a").read_text() == "old"
    write_folder(out, lambda folder: (folder / "a").write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "a").read_text() == "new"


def test_a_folder_that_cannot_be_put_back_is_kept_and_named(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old")
    move = os.replace

    def fail_into_out(src, dst):  # neither the new folder nor the old one can move in
        if Path(dst) == out:
            raise OSError(errno.EIO, "Input/output error")
        move(src, dst)

    monkeypatch.setattr(os, "replace", fail_into_out)
    with pytest.raises(OSError, match="the previous one is in ") as e:
        write_folder(out, lambda folder: (folder / "a").write_text("new"))
    kept = Path(str(e.value).rsplit(" is in ", 1)[1])
    assert kept.name == "out" and (kept / "a").read_text() == "old"


def test_a_ctrl_c_whose_old_folder_cannot_be_put_back_stays_a_ctrl_c(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the new folder moved in, then the old one failing to move back, became an
    OSError (an error exit, no longer an interrupt); it stays Ctrl-C and names the kept folder."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "a").write_text("old")
    move = os.replace

    def interrupted(src, dst):
        if Path(src).name == "out.partial":
            raise KeyboardInterrupt
        if Path(dst) == out:
            raise OSError(errno.EIO, "Input/output error")
        move(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_folder(out, lambda folder: (folder / "a").write_text("new"))
    said = capsys.readouterr().err
    assert said.startswith(f"{out}: not replaced (interrupted); the previous one is in ")
    kept = Path(said.rstrip("\n").rsplit(" is in ", 1)[1])
    assert kept.name == "out" and (kept / "a").read_text() == "old"


@pytest.mark.parametrize(
    "code, said",
    [
        (errno.ENOSPC, "cannot be written: the disk is full. Free space on it"),
        (errno.EDQUOT, "cannot be written: this user's disk quota is used up. Free space or"),
        (errno.EROFS, "cannot be written: the file system is read-only. Make it writable"),
        (errno.EACCES, "cannot be used: permission denied. Let this user write there"),
    ],
)
def test_a_file_that_cannot_be_written_is_one_line_of_the_same_kind(code, said):
    """A full disk, a quota, a read-only file system and a forbidden folder: each the file, what
    stopped it and what to do, then that the same command goes on (for a command that resumes);
    a copy names the file it wrote, not its source. Other errors keep their own text."""
    cut = OSError(code, os.strerror(code), "/out/a.tar.tmp")
    line = os_error_line(cut, resumes=True)
    assert line is not None and line.startswith(f"/out/a.tar.tmp: {said}")
    assert line.endswith(", then run the same command again: it resumes, keeping what it finished")
    assert os_error_line(cut).endswith("then run the same command again")
    copy = OSError(
        code, os.strerror(code), "/tok/model.safetensors", None, "/out/model.safetensors"
    )
    assert os_error_line(copy).startswith("/out/model.safetensors: ")
    assert os_error_line(OSError(code, os.strerror(code))) is None  # no file to name
    assert os_error_line(OSError(errno.EIO, "Input/output error", "/out/a.tar.tmp")) is None
