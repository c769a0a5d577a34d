"""The child of ``decode_guard.decode_in_child``: one video decoded in a process of its own, so
whatever decord leaks on a broken clip dies with it. Reads a pickled ``(raw, sampling, prep,
size)`` from stdin (written by its parent, never by the input) and writes a pickled ``(True,
frames)`` or ``(False, why)`` to stdout."""

from __future__ import annotations

import pickle
import sys

from data.video_frames import decode_frames


def main() -> None:
    raw, sampling, prep, size = pickle.loads(sys.stdin.buffer.read())
    try:
        result: tuple[bool, object] = (True, decode_frames(raw, sampling, prep, size))
    except ValueError as e:
        result = (False, str(e))
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
