"""Video decoding of untrusted inputs in the loader's workers, with a bound on what decord can
leak (each failing decode leaks inside decord, for as long as the worker lives).

Decoding stays in the worker (most clips decode fine: ingest has probed every raw shard's
videos) until ``budget`` failures; then every later clip is decoded in a fresh child process
(``data.video_frames.decode_child``), whose leaks die with it (docs/loader.md, "Raw shards, tokenized in the workers"). A
subprocess rather than multiprocessing or a bare fork: a DataLoader worker is a daemon process,
which multiprocessing does not let have children, and a forked copy of a worker would have to
leave through ``os._exit``. A child that dies (a crash inside FFmpeg) is a failed decode like
any other: the sample is skipped and counted by the stream, never a dead worker.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

from data.video_frames import decode_frames

# The child imports data.video_frames alone: importing anything under data.loader would load
# torch and numba first (seconds per clip, where the decode itself takes milliseconds).
CHILD_COMMAND = [sys.executable, "-c", "from data.video_frames import decode_child; decode_child()"]


class DecodeGuard:
    """``decode_frames`` with this process's failures counted (one guard per worker)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.failures = 0
        self.isolated = 0  # decodes run in a child

    def __call__(self, raw: bytes, sampling, prep, size=None):
        isolate = self.failures >= self.budget
        self.isolated += isolate
        try:
            return (decode_in_child if isolate else decode_frames)(raw, sampling, prep, size)
        except ValueError:
            self.failures += 1
            raise


def decode_in_child(raw: bytes, sampling, prep, size=None):
    """``decode_frames`` in a fresh Python process (``decode_child``); its result (or its error) comes
    back pickled on its stdout."""
    job = pickle.dumps((raw, sampling, prep, size), protocol=pickle.HIGHEST_PROTOCOL)
    done = subprocess.run(CHILD_COMMAND, input=job, capture_output=True)
    if done.returncode != 0 or not done.stdout:
        raise ValueError(f"cannot decode video: the decoding process died (exit {done.returncode})")
    ok, payload = pickle.loads(done.stdout)  # our own child's bytes, never the input's
    if ok is None:  # the machine's failure, not the clip's: as it would be in this process
        raise payload
    if not ok:
        raise ValueError(str(payload))
    return payload
