"""Job functions for the engine tests: importable by spawned workers and Ray actors (tests/ is
on the path of every worker the tests start)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from data.media import probe_video


def failing_decodes(n: int) -> int:
    """Feed decord ``n`` clips that are not video (each a real failed decode); the worker's pid."""
    for i in range(n):
        got = probe_video(
            b"\x00\x00\x00\x18ftypmp42 not a video " + str(i).encode(), "x.mp4", max_seconds=9
        )
        assert not hasattr(got, "fps"), "garbage decoded as video"
    return os.getpid()


def die_once(marker: str) -> str:
    """Kill this worker the first time (as the OOM killer would), succeed the second."""
    if not Path(marker).exists():
        Path(marker).write_text("died once")
        os._exit(9)
    return "survived"


def raise_value_error(x: int) -> int:
    raise ValueError(f"job {x} is bad input")


def sleep_marked(job: tuple[str, float]) -> int:
    """Write this worker's pid into the folder ``job[0]`` (it has taken a job), then sleep."""
    Path(job[0], str(os.getpid())).write_text("running")
    time.sleep(job[1])
    return os.getpid()
