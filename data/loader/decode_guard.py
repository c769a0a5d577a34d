"""Video decoding of untrusted inputs in the loader's workers, with a bound on what decord can
leak: each failing decode leaks ~40 KB inside decord (decord issues #208, #197, #157), ~23 MB
per 600 failures, for as long as the worker lives.

Design choices:
- Decoding stays in the worker (no process per clip: most clips decode fine, and ingest has
  already probed every raw shard's videos). Each worker counts its failed decodes.
- Past ``budget`` failures (a worker that keeps meeting broken clips), every later clip is
  decoded in a child forked for it: the frames come back through a pipe, whatever decord leaks
  dies with the child, and the worker's memory stays where it was. A fork of a worker costs a
  few milliseconds; only such workers pay it. ``os.fork`` rather than multiprocessing: a
  DataLoader worker is a daemon process, which multiprocessing does not let have children.
- A child that dies (a crash inside FFmpeg) is a failed decode like any other: the sample is
  skipped and counted by the stream, never a dead worker.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys

from data.video_frames import decode_frames

DEFAULT_BUDGET = 64  # failed decodes a worker absorbs (~3 MB of decord leaks) before forking


class DecodeGuard:
    """``decode_frames`` with this process's failures counted (one guard per worker)."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self.failures = 0
        self.isolated = 0  # decodes run in a child

    def __call__(self, raw: bytes, sampling, prep, size=None):
        if self.failures < self.budget:
            try:
                return decode_frames(raw, sampling, prep, size)
            except ValueError:
                self.failures += 1
                raise
        self.isolated += 1
        try:
            return decode_in_child(raw, sampling, prep, size)
        except ValueError:
            self.failures += 1
            raise


def decode_in_child(raw: bytes, sampling, prep, size=None):
    """``decode_frames`` in a forked child; its result (or its error) comes back pickled."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: decode, send, leave without running any of the parent's cleanup
        code = 0
        try:
            os.close(read_fd)
            result: tuple[bool, object]
            try:
                result = (True, decode_frames(raw, sampling, prep, size))
            except ValueError as e:
                result = (False, str(e))
            blob = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write_fd, "wb") as f:
                f.write(struct.pack("<Q", len(blob)))
                f.write(blob)
        except BaseException:  # noqa: BLE001 - nothing may escape into the parent's code
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as f:
            head = f.read(8)
            blob = f.read(struct.unpack("<Q", head)[0]) if len(head) == 8 else b""
    finally:
        _, status = os.waitpid(pid, 0)
    if not blob:
        raise ValueError(f"cannot decode video: the decoding process died (status {status})")
    ok, payload = pickle.loads(blob)  # our own child's bytes, never the input's
    if not ok:
        raise ValueError(str(payload))
    return payload
