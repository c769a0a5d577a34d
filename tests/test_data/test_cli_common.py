"""The commands' shared output rules (data/cli/common.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from data.cli.common import write_folder


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
