"""Which samples a consumer (one rank's one worker) reads, in which order, in each epoch: shards
shuffled per epoch, samples within windows of ``buffer`` positions (a bounded shuffle that keeps
reads local to a few shards), consumer c of C taking positions c, c + C, ...; seeds hashed
per window, so any consumer computes any position alone (docs/loader.md, "Order").

- A loader state's cursors are positions in this order, and the state names it
  (``ORDER_VERSION``; another is refused, data/loader/stream_state.py).
- After a ``redistribute`` an epoch may carry a *skip mask* over its positions (those the old
  consumers consumed), stored packed (bits, zlib, base64): the consumed set is nearly a prefix.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

import numpy as np


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


ORDER_VERSION = 2  # the order below, as a loader state names it ("order")
_PLAIN_WINDOW = 4096  # positions computed at a time when there is no sample shuffle


class EpochOrder:
    """The order of one source and epoch: position -> sample id, a window at a time.

    Positions run over the shards in their shuffled order (each shard's samples in index
    order); window w (positions [w * buffer, (w + 1) * buffer)) is shuffled by an RNG seeded
    from (seed, epoch, source, w)."""

    def __init__(
        self,
        counts: np.ndarray,
        *,
        seed: int,
        epoch: int,
        source: str,
        buffer: int,
        shuffle_shards: bool,
    ) -> None:
        counts = np.asarray(counts, np.int64)
        rng = np.random.default_rng(seed_of(seed, epoch, source, "order"))
        perm = rng.permutation(len(counts)) if shuffle_shards else np.arange(len(counts))
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.first = first[perm]  # id of the first sample of each shard, shards in order
        self.perm = perm  # the shards in order
        self.starts = np.concatenate([[0], np.cumsum(counts[perm])]).astype(np.int64)
        self.n = int(self.starts[-1])
        self.shuffle = buffer > 1
        self.window = buffer if self.shuffle else _PLAIN_WINDOW
        self.key = (seed, epoch, source)

    def shards_from(self, position: int) -> np.ndarray:
        """The shards in order from the one holding ``position`` on (those with samples)."""
        at = int(np.searchsorted(self.starts, position, side="right")) - 1
        counts = self.starts[at + 1 :] - self.starts[at:-1]
        return self.perm[at:][counts > 0]

    def window_samples(self, w: int) -> np.ndarray:
        """int64: the samples at positions [w * window, (w + 1) * window) (fewer at the end)."""
        lo = w * self.window
        hi = min(lo + self.window, self.n)
        pos = np.arange(lo, hi, dtype=np.int64)
        if self.shuffle:
            rng = np.random.default_rng(seed_of(*self.key, "window", w))
            pos = lo + rng.permutation(hi - lo)
        shard = np.searchsorted(self.starts, pos, side="right") - 1
        return self.first[shard] + (pos - self.starts[shard])

    def full(self) -> np.ndarray:
        """The whole order (O(samples): redistributed epochs only)."""
        n_windows = -(-self.n // self.window)
        parts = [self.window_samples(w) for w in range(n_windows)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class ConsumerSlice:
    """Consumer c's positions c, c + C, ... of an ``EpochOrder``, as a lazy sequence of samples
    (the window under the cursor is computed once and kept)."""

    def __init__(self, order: EpochOrder, consumer: int, consumers: int) -> None:
        self.order, self.consumer, self.consumers = order, consumer, consumers
        self.n = len(range(consumer, order.n, consumers))
        self._w, self._samples = -1, np.zeros(0, np.int64)  # the window under the cursor

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):
        if isinstance(k, slice):  # int64 samples, as a slice of an array order gives them
            pos = self.consumer + np.arange(*k.indices(self.n), dtype=np.int64) * self.consumers
            win = self.order.window
            out = np.empty(len(pos), np.int64)
            w_of = pos // win
            for w in np.unique(w_of).tolist():  # a window at a time
                sel = w_of == w
                out[sel] = self._window(w)[pos[sel] - w * win]
            return out
        if not -self.n <= k < self.n:
            raise IndexError(k)
        pos = self.consumer + (k % self.n) * self.consumers
        return self._window(pos // self.order.window).item(pos % self.order.window)

    def _window(self, w: int) -> np.ndarray:
        if w != self._w:
            self._w, self._samples = w, self.order.window_samples(w)
        return self._samples


def pack_mask(mask: np.ndarray) -> str:
    """A boolean mask as text for a loader state (JSON and ``torch.load(weights_only=True)`` safe)."""
    return base64.b64encode(zlib.compress(np.packbits(mask.astype(bool)).tobytes(), 6)).decode(
        "ascii"
    )


def unpack_mask(text: str, n: int) -> np.ndarray:
    bits = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    if len(bits) != (n + 7) // 8:
        raise ValueError(f"a skip mask of {len(bits) * 8} bits for an epoch order of {n} samples")
    return np.unpackbits(bits, count=n).astype(bool)
