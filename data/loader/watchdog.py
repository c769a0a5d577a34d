"""The loader's report of a read that hangs: a thread that prints, while a read has not
returned after ``stall_seconds``, which shard and sample it is (``sample_where``, also the
name the stream gives a skipped sample). Separate from the stream because it is a thread of its
own with its own lifetime (stopped at interpreter exit), not part of what the stream computes.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time

from data.loader.table import SampleTable


def sample_where(t: SampleTable, sample: int) -> tuple[str, str]:
    """(shard URL, key) of a sample, for messages; the key is looked up only when needed, and a
    shard whose index cannot be read gives the sample's number instead."""
    try:
        return t.shards[t.shard_of(sample)], t.key_of(sample)
    except (OSError, ValueError, IndexError):
        return t.name, f"#{sample}"


class Watchdog:
    """Reports a read that has not returned after ``seconds``, naming what it was reading."""

    def __init__(self, seconds: float, label: str) -> None:
        self.seconds, self.label = seconds, label
        # (what is being read: a label, or (table, sample) formatted only if it stalls; since)
        self.current: tuple[str | tuple, float] | None = None
        self._stop = threading.Event()
        if seconds > 0:
            threading.Thread(target=self._watch, daemon=True).start()
            atexit.register(self._stop.set)  # never left running into interpreter shutdown

    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds, 5.0)):
            cur = self.current
            if cur and time.monotonic() - cur[1] > self.seconds:
                what = cur[0] if isinstance(cur[0], str) else " sample ".join(sample_where(*cur[0]))
                print(
                    f"[loader {self.label}] read stalled for {time.monotonic() - cur[1]:.0f} s: {what}",
                    file=sys.stderr,
                    flush=True,
                )
                self.current = (cur[0], time.monotonic())
