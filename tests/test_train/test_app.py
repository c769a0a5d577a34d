"""train/app.py: how a rank of a multi-process run leaves, and what a full disk's line says."""

from __future__ import annotations

import errno
import subprocess
import sys

from train.app import disk_failure

ENTRY = """
import atexit, logging, sys
from train.app import leave_rank
logging.basicConfig(filename=sys.argv[1])
logging.getLogger("train").warning("logged")
print("printed")
print("to stderr", file=sys.stderr)
atexit.register(print, "finalized")
leave_rank(3)
"""


def test_a_rank_leaves_with_its_code_and_output_but_no_interpreter_teardown(tmp_path):
    """``leave_rank`` skips the interpreter's finalization (where PyTorch's C++ threads can abort
    a finished rank), yet nothing the rank printed or logged is lost, and its exit code stands."""
    log = tmp_path / "rank.log"
    done = subprocess.run(
        [sys.executable, "-c", ENTRY, str(log)], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "printed\n", "to stderr\n")
    assert "logged" in log.read_text()


def test_a_full_disk_names_the_save_it_cut_short_as_room_to_free(tmp_path):
    """A rerun on a disk still full stops (at its run lock, say) before it removes the save the
    disk cut short: the line says that folder may go."""
    checkpoints = tmp_path / "checkpoints"
    for step in (3, 4):
        (checkpoints / f"step_0000000{step}").mkdir(parents=True)
    (checkpoints / "step_00000003" / "meta.json").write_text("{}")
    (checkpoints / "latest").write_text("step_00000003\n")
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run.lock"))
    assert disk_failure(full, tmp_path) == (
        f"stopped: {tmp_path / 'run.lock'}: No space left on device; {checkpoints / 'latest'} "
        "names step_00000003: the same command resumes from it once the disk has room and can be "
        f"written again (step_00000004 in {checkpoints}: cut short, deleting frees room)"
    )
    (checkpoints / "step_00000004" / "meta.json").write_text("{}")  # complete, not latest yet
    assert "cut short" not in disk_failure(full, tmp_path)
