"""train/app.py: how a rank of a multi-process run leaves."""

from __future__ import annotations

import subprocess
import sys

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
